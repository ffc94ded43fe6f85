"""hetero-plan against an exhaustive enumerator, against baselines, and its search time.

    python -m bench.planner.plan_bench            # 200 small clusters, 16/64/256/1024 GPUs (several minutes)
    python -m bench.planner.plan_bench --quick    # a few of each (the test suite runs this)

Every plan is scored by the same cost model and simulator (``hetero_llm.planner.cost``); nothing
here runs a model. Results: bench/results/plan_bench.{json,md,png} (or --out-dir).

1. **vs exhaustive**: seeded random clusters of 4-8 devices (2-3 kinds from the catalogue, 1-3
   domains, at most 4 nodes) with an 8-layer model; a draw whose space holds more than 60 000
   structures is redrawn (the enumerator visits about 2 000 a second). The enumerator visits every structure the
   planner's space holds: every TP grouping of every node, every partition of the TP groups into
   pipelines (as multisets: groups of one node and TP size are interchangeable), every stage order of
   every pipeline, every microbatch size and schedule; each structure's layers and batch shares come
   from the same exact sub-solvers the planner uses (min-max DP, min-max microbatch split). A
   structure is simulated only when a lower bound (its slowest stage's busy time + sync + optimizer)
   beats the best so far.
2. **vs baselines** (plan_baselines.py) on generated clusters of 8-GPU nodes with Llama-2 7B.
3. **search time** of the planner on those clusters, one process (one core).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import benchlib
from bench.planner import plan_baselines
from hetero_llm.layout import (
    Backend,
    ClusterSpec,
    CrossDomainSpec,
    DataSpec,
    DomainKind,
    DomainSpec,
    Mlp,
    ModelSpec,
    NodeSpec,
    Norm,
    Position,
    Precision,
    TrainSpec,
    dumps_cluster,
)
from hetero_llm.planner import place_seeds, plan_cluster
from hetero_llm.planner.cluster import load_cluster
from hetero_llm.planner.search import Planner

ROOT = Path(__file__).resolve().parents[2]

KINDS_SMALL = ["a100-40g", "a6000", "rtx4090", "rtx3090", "rtx3080ti"]
KINDS_LARGE = ["h100-sxm", "a100-80g", "a100-40g", "a6000", "rtx4090", "rtx3090"]

SMALL_MODEL = ModelSpec(
    layers=8,
    hidden=2048,
    heads=16,
    ffn=5504,
    vocab=32000,
    seq_len=2048,
    norm=Norm.RMSNORM,
    position=Position.ROPE,
    mlp=Mlp.SWIGLU,
)
LLAMA7B = ModelSpec(
    layers=32,
    hidden=4096,
    heads=32,
    ffn=11008,
    vocab=32000,
    seq_len=4096,
    norm=Norm.RMSNORM,
    position=Position.ROPE,
    mlp=Mlp.SWIGLU,
)


def cluster_toml(
    model: ModelSpec,
    batch: int,
    nodes: list[tuple[int, str, int]],
    domains: list[tuple[float, float]],
    cross: tuple[float, float],
    max_evals: int,
    time_cap_s: float = 0.0,
) -> str:
    """nodes: (devices, kind, domain index); domains: (Gbit/s, us). ``max_evals``: the search's work budget
    (``plan.max_evals``, 0 = the planner's default); ``time_cap_s``: its wall-clock safety net
    (``plan.time_budget_s``, 0 = none, so that the plan is a function of the cluster only)."""
    train = TrainSpec(steps=1, global_batch=batch, precision=Precision.BF16)
    cluster = ClusterSpec(
        nodes=tuple(
            NodeSpec(name=f"n{i}", devices=tuple(f"cuda:{j}" for j in range(n)), domain=f"d{d}")
            for i, (n, _, d) in enumerate(nodes)
        ),
        backend=Backend.NCCL,
        domains=tuple(
            DomainSpec(name=f"d{i}", kind=DomainKind.IB, bandwidth_gbps=float(bw), latency_us=float(lat))
            for i, (bw, lat) in enumerate(domains)
        ),
        cross_domain=CrossDomainSpec(bandwidth_gbps=float(cross[0]), latency_us=float(cross[1])),
    )
    plan = {
        "max_evals": max_evals,
        "time_budget_s": time_cap_s,
        "nodes": {f"n{i}": kind for i, (_, kind, _) in enumerate(nodes)},
    }
    return dumps_cluster({"model": model, "train": train, "data": DataSpec(), "cluster": cluster}, {"plan": plan})


EXHAUSTIVE_LIMIT = 60_000  # structures; a cluster whose space is larger is redrawn (the enumerator takes ~0.5 ms each)


def small_cluster(seed: int) -> str:
    """A random cluster of 4-8 devices whose space the enumerator can visit (redrawn until it can)."""
    for attempt in range(100):
        text = _draw_small(seed * 100 + attempt)
        if text is not None and Planner(load(text)).all_structures(EXHAUSTIVE_LIMIT) is not None:
            return text
    raise RuntimeError(f"no tractable small cluster for seed {seed}")


def _draw_small(seed: int) -> str | None:
    rng = random.Random(seed)
    total = rng.randint(4, 8)
    kinds = rng.sample(KINDS_SMALL, rng.randint(2, 3))
    n_dom = rng.randint(1, 3)
    sizes = []
    while sum(sizes) < total:
        sizes.append(min(rng.randint(1, 4), total - sum(sizes)))
    while len(sizes) > 4:  # at most 4 nodes
        last = sizes.pop()
        sizes[-1] += last
    if len(sizes) < 2:  # one node would be one kind
        return None
    nodes = [
        (s, kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds), rng.randrange(n_dom) if i >= n_dom else i)
        for i, s in enumerate(sizes)
    ]
    domains = [(rng.choice([25, 100, 200]), rng.choice([2, 5, 10])) for _ in range(n_dom)]
    return cluster_toml(SMALL_MODEL, 8, nodes, domains, (rng.choice([10, 25]), 20), 0)


def large_cluster(n_gpus: int, seed: int, max_evals: int = 0, time_cap_s: float = 0.0) -> str:
    rng = random.Random(1000 * n_gpus + seed)
    kinds = rng.sample(KINDS_LARGE, rng.randint(2, 3))
    n_dom = rng.randint(1, 3)
    nodes = [(8, rng.choice(kinds), rng.randrange(n_dom)) for _ in range(n_gpus // 8)]
    domains = [(rng.choice([100, 200, 400]), rng.choice([2, 5])) for _ in range(n_dom)]
    batch = max(64, n_gpus)
    return cluster_toml(LLAMA7B, batch, nodes, domains, (rng.choice([25, 100]), 20), max_evals, time_cap_s)


def load(text: str):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "cluster.toml"
        path.write_text(text)
        return load_cluster(path)


# ------------------------------------------------------------------------------------ exhaustive


def exhaustive(cluster) -> tuple[float, int]:
    """The optimum over every structure (``Planner.all_structures`` without a limit), and how many."""
    pl = Planner(cluster, budget_s=0, max_evals=10**12)
    structures = pl.all_structures(10**9)
    pl.exact(structures)
    return min(s.step_time for _, s in pl.scored.values()), len(structures)


# ------------------------------------------------------------------------------------ runs


def checkpoint(path: Path | None, key: str, rows: list[dict]) -> None:
    """Write the rows so far (a long run that is stopped still leaves its results)."""
    if path is not None:
        path.write_text(json.dumps({key: rows}, indent=1, default=str))


def run_small(seeds: range, partial: Path | None = None, optima: dict[int, dict] | None = None) -> list[dict]:
    rows = []
    for seed in seeds:
        cluster = load(small_cluster(seed))
        t0 = time.perf_counter()
        if optima and seed in optima:  # an earlier run's enumeration (same generator and cost model)
            opt, visited = optima[seed]["optimum"], optima[seed]["structures"]
        else:
            opt, visited = exhaustive(cluster)
        t1 = time.perf_counter()
        # the search (it does not enumerate; bench/planner/plan_exhaustive.py compares it with the whole space's optimum)
        planner = plan_cluster(cluster).score.step_time
        t2 = time.perf_counter()
        ratio = planner / opt
        rows.append(
            {
                "seed": seed,
                "devices": cluster.num_devices,
                "kinds": len({x.kind.name for x in cluster.nodes}),
                "domains": len(cluster.spec.domains),
                "optimum": opt,
                "ratio": ratio,
                "structures": visited,
                "exhaustive_s": t1 - t0,
                "planner_s": t2 - t1,
            }
        )
        print(
            f"small {seed}: {cluster.num_devices} devices, planner/optimum {rows[-1]['ratio']:.4f} ({visited} structures in {t1 - t0:.1f} s, planner {t2 - t1:.2f} s)",
            flush=True,
        )
        checkpoint(partial, "small", rows)
    return rows


def run_large(
    sizes: list[int],
    seeds: int,
    hexi_seeds: int,
    max_evals: int,
    time_cap_s: float,
    partial: Path | None = None,
    rows: list[dict] | None = None,
    first_seed: int = 0,
) -> list[dict]:
    rows = [] if rows is None else rows
    for n_gpus in sizes:
        for seed in range(first_seed, first_seed + seeds):
            cluster = load(large_cluster(n_gpus, seed, max_evals, time_cap_s))
            t0 = time.perf_counter()
            res = plan_cluster(cluster)
            search_s = time.perf_counter() - t0
            ours = res.score
            pl = Planner(cluster)
            hexi = []
            for s in range(hexi_seeds):
                cand = plan_baselines.hexiscale(cluster, pl.cost, s)
                hexi.append(pl.cost.score(cand).step_time if cand is not None else math.inf)
            hexi_med = statistics.median(hexi)
            metis = plan_baselines.metis_style(cluster, pl.cost, pl)
            seeds_ = [pl.cost.score(c) for c in place_seeds(cluster)]
            place = min((s.step_time for s in seeds_), default=math.inf)
            mem_ok = all(m <= c for ms, cs in zip(ours.memory, ours.capacity) for m, c in zip(ms, cs))
            rows.append(
                {
                    "gpus": n_gpus,
                    "seed": seed,
                    "ours": ours.step_time,
                    "mfu": ours.mfu,
                    "search_s": search_s,
                    "evaluated": res.evaluated,
                    "cut_by_time": res.cut_by_time,
                    "hexiscale": hexi_med,
                    "hexiscale_seeds": hexi,
                    "hexiscale_feasible": sum(math.isfinite(h) for h in hexi),
                    "metis": metis[1].step_time if metis else math.inf,
                    "place": place,
                    "memory_ok": mem_ok,
                }
            )
            r = rows[-1]
            print(
                f"{n_gpus} GPUs seed {seed}: ours {r['ours']:.3f} s (MFU {r['mfu']:.1%}, {search_s:.1f} s search), "
                f"HexiScale {hexi_med:.3f} ({r['hexiscale_feasible']}/{hexi_seeds} fit), Metis-style {r['metis']:.3f}, "
                f"hetero-place {place:.3f}",
                flush=True,
            )
            checkpoint(partial, "large", rows)
    return rows


def run_timing(sizes: list[int], seeds: int, max_evals: int, time_cap_s: float) -> list[dict]:
    """Search time alone (run it under an exclusive lock: nothing else computing)."""
    rows = []
    for n_gpus in sizes:
        for seed in range(seeds):
            cluster = load(large_cluster(n_gpus, seed, max_evals, time_cap_s))
            t0, c0 = time.perf_counter(), time.process_time()
            res = plan_cluster(cluster)
            rows.append(
                {
                    "gpus": n_gpus,
                    "seed": seed,
                    "search_s": time.perf_counter() - t0,
                    "cpu_s": time.process_time() - c0,
                    "evaluated": res.evaluated,
                    "ours": res.score.step_time,
                }
            )
            print(
                f"timing {n_gpus} GPUs seed {seed}: {rows[-1]['search_s']:.2f} s ({rows[-1]['cpu_s']:.2f} s CPU), "
                f"{res.evaluated} plans simulated",
                flush=True,
            )
    return rows


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x) and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def summarize(small: list[dict], large: list[dict]) -> str:
    lines = []
    if small:
        ratios = [r["ratio"] for r in small]
        within1 = sum(r <= 1.01 for r in ratios) / len(ratios)
        lines += [
            "## vs exhaustive",
            "",
            f"{len(small)} clusters: planner within 1% of the optimum on {within1:.1%}, worst "
            f"{max(ratios):.4f}x, median {statistics.median(ratios):.4f}x; more than 5% worse on "
            f"{sum(r > 1.05 for r in ratios)}; better than the enumerated optimum on {sum(r < 0.9999 for r in ratios)} "
            f"(plans that leave a device idle, which the enumeration does not visit, or a hetero-place seed's "
            f"own split); "
            f"median structures enumerated {statistics.median(r['structures'] for r in small):.0f} (every "
            "device used: bench/planner/plan_exhaustive.py enumerates device subsets too)",
            "",
        ]
    if large:
        lines += [
            "## vs baselines and search time",
            "",
            "| GPUs | clusters | speedup vs HexiScale (geomean) | vs Metis-style | vs hetero-place (geomean, min) "
            "| HexiScale plans that fit | search s (median, max) | MFU (median) | memory ok |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for n in sorted({r["gpus"] for r in large}):
            rs = [r for r in large if r["gpus"] == n]
            hx = geomean([r["hexiscale"] / r["ours"] for r in rs])
            mt = geomean([r["metis"] / r["ours"] for r in rs])
            pc = [r["place"] / r["ours"] for r in rs]
            pcf = [x for x in pc if math.isfinite(x)]
            fit = sum(r["hexiscale_feasible"] for r in rs), sum(len(r["hexiscale_seeds"]) for r in rs)
            st = [r["search_s"] for r in rs]
            lines.append(
                f"| {n} | {len(rs)} | {hx:.3f}x | {mt:.3f}x | {geomean(pc):.3f}x, min "
                f"{min(pcf) if pcf else math.nan:.3f}x ({len(pc) - len(pcf)} with no fitting place plan) | "
                f"{fit[0]}/{fit[1]} | {statistics.median(st):.1f}, {max(st):.1f} | "
                f"{statistics.median(r['mfu'] for r in rs):.1%} | {all(r['memory_ok'] for r in rs)} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(small: list[dict], large: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [k for k, rows in (("small", small), ("large", large)) if rows]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    ax_small, ax_large = (dict(zip(panels, axes[0])).get(k) for k in ("small", "large"))
    if small:
        ax_small.hist([r["ratio"] for r in small], bins=30)
        ax_small.set_xlabel("planner step time / exhaustive optimum")
        ax_small.set_ylabel("clusters")
        ax_small.set_title(f"{len(small)} small clusters")
    if large:
        sizes = sorted({r["gpus"] for r in large})
        for key, label in (("hexiscale", "HexiScale"), ("metis", "Metis-style"), ("place", "hetero-place")):
            ys = [geomean([r[key] / r["ours"] for r in large if r["gpus"] == n]) for n in sizes]
            ax_large.plot(sizes, ys, marker="o", label=label)
        ax_large.axhline(1.0, color="gray", lw=0.8)
        ax_large.set_xscale("log", base=2)
        ax_large.set_xlabel("GPUs")
        ax_large.set_ylabel("baseline step time / ours (geomean)")
        ax_large.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few clusters of each kind (for the test suite)")
    ap.add_argument("--small", type=int, default=200, help="random small clusters vs exhaustive")
    ap.add_argument("--small-start", type=int, default=0, help="first small cluster's seed (to run the 200 in chunks)")
    ap.add_argument(
        "--optima",
        default="",
        help="comma list of earlier plan_bench JSON results: take the small "
        "clusters' exhaustive optima from them instead of enumerating again (same cost model only)",
    )
    ap.add_argument("--sizes", default="16,64,256,1024", help="GPU counts of the large clusters")
    ap.add_argument("--seeds", default="20,20,5,2", help="clusters per size (comma list, one per size)")
    ap.add_argument("--hexiscale-seeds", type=int, default=5)
    ap.add_argument("--seed-start", type=int, default=0, help="first large cluster's seed (to run a size in chunks)")
    ap.add_argument(
        "--max-evals",
        type=int,
        default=0,
        help="the search's work budget (plan.max_evals: plans simulated); 0 = the planner's default",
    )
    ap.add_argument(
        "--time-cap",
        type=float,
        default=0.0,
        help="the search's wall-clock safety net (plan.time_budget_s), 0 = none: a capped search depends on the machine",
    )
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument(
        "--timing",
        type=int,
        default=0,
        metavar="N",
        help="only time the search on N clusters per size (run alone: flock -x)",
    )
    ap.add_argument("--tag", default="", help="suffix of the result files (plan_bench_TAG.*), for split runs")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    seeds = [int(x) for x in args.seeds.split(",")]
    if args.quick:
        sizes, seeds, args.hexiscale_seeds = [16], [1], 2  # and small clusters 1 and 2 (the quick ones)
    t0, load0 = time.time(), os.getloadavg()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "plan_bench" + (f"_{args.tag}" if args.tag else "")
    partial = out / f"{name}.partial.json"
    if args.timing:
        rows = run_timing(sizes, args.timing, args.max_evals, args.time_cap)
        lines = [
            "| GPUs | clusters | search s (median) | max | CPU s (median) | max | plans simulated (median) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for n in sizes:
            rs = [r for r in rows if r["gpus"] == n]
            wall, cpu = [r["search_s"] for r in rs], [r["cpu_s"] for r in rs]
            lines.append(
                f"| {n} | {len(rs)} | {statistics.median(wall):.2f} | {max(wall):.2f} | {statistics.median(cpu):.2f} | "
                f"{max(cpu):.2f} | {statistics.median(r['evaluated'] for r in rs):.0f} |"
            )
        (out / f"{name}.json").write_text(
            json.dumps(
                {"timing": rows, "command": " ".join(sys.argv), "load_before": load0, "load_after": os.getloadavg()},
                indent=1,
            )
        )
        head = benchlib.report_head(name, benchlib.machine(), load0, os.getloadavg())
        (out / f"{name}.md").write_text("\n".join([*head, *lines]) + "\n")
        print("\n".join(lines))
        return
    optima = {r["seed"]: r for f in args.optima.split(",") if f for r in json.loads(Path(f).read_text())["small"]}
    small = run_small(
        range(1, 3) if args.quick else range(args.small_start, args.small_start + args.small), partial, optima=optima
    )
    large: list[dict] = []
    for n, s in zip(sizes, seeds + [seeds[-1]] * len(sizes)):
        run_large([n], s, args.hexiscale_seeds, args.max_evals, args.time_cap, partial, large, args.seed_start)
    partial.unlink(missing_ok=True)
    text = summarize(small, large)
    print(text)
    (out / f"{name}.json").write_text(
        json.dumps(
            {"small": small, "large": large, "seconds": time.time() - t0, "command": " ".join(sys.argv)},
            indent=1,
            default=str,
        )
    )
    (out / f"{name}.md").write_text(
        "\n".join([*benchlib.report_head(name, benchlib.machine(), load0, os.getloadavg()), text])
    )
    plot(small, large, out / f"{name}.png")


if __name__ == "__main__":
    main()
