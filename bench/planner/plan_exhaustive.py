"""hetero-plan's search against the exhaustive reference on small clusters, device subsets included.

    python -m bench.planner.plan_exhaustive                 # 200 clusters (minutes)
    python -m bench.planner.plan_exhaustive --clusters 20   # the first 20 (tests/unit/test_plan_space.py runs 12 of these)

Every plan is scored by the same cost model and simulator (``hetero_llm.planner.cost``); nothing here runs a
model. The reference (``hetero_llm.planner.exact.all_structures(subsets=True)``) enumerates the planner's whole
space: every subset of the devices (the rest idle), every TP grouping of every node, every partition of the
groups into pipelines and every stage order, every microbatch size, every schedule of ``plan.schedules``
(interleaved with every chunk count dividing the layers), every optimizer of ``plan.optimizers``; each structure is completed by the search's exact
sub-solvers (the layer DP, which picks each stage's recompute, and the batch split) and simulated when its
lower bound beats the best so far. The search (``plan_cluster``, its default work budget) does not enumerate.

The clusters (``draw``, seeded): 3 device kinds of the catalogue, an odd number of devices (3, 5 or 7) on 3-4
nodes of 1-4 devices, 2-3 NIC domains of 10-200 Gbit/s, and a model sized to the cluster's memory: its weights
and AdamW state (16 bytes a parameter) take 0.5-1.3x the largest device's memory, so a plan must pipeline it
over several devices or recompute. A draw whose space holds more than ``SPACE_LIMIT`` structures is redrawn.
Results: bench/results/plan_exhaustive.{json,md} (or --out-dir).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import sys
import time
from pathlib import Path

from bench.common import benchlib
from bench.planner.plan_bench import cluster_toml, load
from hetero_llm.layout import Mlp, ModelSpec, Norm, Position
from hetero_llm.planner import catalogue, plan_cluster, with_optimizer
from hetero_llm.planner.search import Planner

ROOT = Path(__file__).resolve().parents[2]
KINDS = ["a100-40g", "a6000", "rtx4090", "rtx3090", "rtx3080ti"]
SPACE_LIMIT = 60_000  # structures of one cluster's space (the reference scores about ten thousand a second)
WITHIN = 0.01  # the targets: >= 95% of clusters within 1% of the optimum, none worse than 1.03x
TARGET_SHARE, TARGET_WORST = 0.95, 1.03


def _model(rng: random.Random, memory_gb: float) -> ModelSpec | None:
    """A model whose weights and AdamW state take 0.5-1.3x ``memory_gb`` (None: none of the draws does)."""
    for _ in range(20):
        hidden = rng.choice([1024, 2048, 2560, 3072, 4096])
        layers = rng.choice([4, 6, 8, 12])
        ffn = round(8 * hidden / 3 / 64) * 64
        params = layers * (4 * hidden**2 + 3 * hidden * ffn) + 2 * 32000 * hidden
        if 0.5 <= params * 16 / 1e9 / memory_gb <= 1.3:
            return ModelSpec(
                layers=layers,
                hidden=hidden,
                heads=16,
                ffn=ffn,
                vocab=32000,
                seq_len=rng.choice([1024, 2048]),
                norm=Norm.RMSNORM,
                position=Position.ROPE,
                mlp=Mlp.SWIGLU,
            )
    return None


def _draw(seed: int) -> str | None:
    rng = random.Random(seed)
    kinds = rng.sample(KINDS, 3)
    total = rng.choice([3, 5, 7])
    n_nodes = rng.randint(3, min(4, total))
    sizes = [1] * n_nodes
    while sum(sizes) < total:
        i = rng.randrange(n_nodes)
        if sizes[i] < 4:
            sizes[i] += 1
    n_dom = rng.randint(2, min(3, n_nodes))
    node_kinds = kinds + [rng.choice(kinds) for _ in range(n_nodes - 3)]
    nodes = [(s, k, i if i < n_dom else rng.randrange(n_dom)) for i, (s, k) in enumerate(zip(sizes, node_kinds))]
    domains = [(rng.choice([10, 25, 100, 200]), rng.choice([2, 5, 10])) for _ in range(n_dom)]
    model = _model(rng, max(catalogue.KINDS[k].memory_gb for k in kinds))
    if model is None:
        return None
    return cluster_toml(model, rng.choice([4, 6, 8]), nodes, domains, (rng.choice([5, 10, 25]), 20), 0)


@functools.cache  # a pure function of the seed; a process that asks again (tests/unit/test_plan_space.py) draws once
def draw(seed: int) -> str:
    """Small cluster ``seed``: the first of its draws whose space the reference can enumerate."""
    for attempt in range(100):
        text = _draw(seed * 100 + attempt)
        if text is not None and Planner(load(text)).all_structures(SPACE_LIMIT, subsets=True) is not None:
            return text
    raise RuntimeError(f"no tractable small cluster for seed {seed}")


def reference(cluster) -> tuple[float, int]:
    """The optimum over the whole space (device subsets included, every optimizer of ``plan.optimizers``), and
    how many structures it holds."""
    best, visited = math.inf, 0
    for optimizer in cluster.limits.optimizers:
        pl = Planner(with_optimizer(cluster, optimizer), budget_s=0, max_evals=10**12)
        structures = pl.all_structures(10**9, subsets=True)
        pl.exact(structures)
        best = min([best] + [s.step_time for _, s in pl.scored.values()])
        visited += len(structures)
    return best, visited


def run(seeds, optima: dict[int, dict] | None = None, partial: Path | None = None) -> list[dict]:
    """``optima``: an earlier run's rows by seed, whose reference optimum is taken instead of enumerating again
    (the reference is a function of the generator and the cost model only); ``partial``: the rows so far are
    written there after each cluster."""
    rows = []
    for seed in seeds:
        cluster = load(draw(seed))
        t0 = time.perf_counter()
        if optima and seed in optima:
            opt, visited = optima[seed]["optimum"], optima[seed]["structures"]
        else:
            opt, visited = reference(cluster)
        t1 = time.perf_counter()
        res = plan_cluster(cluster)
        t2 = time.perf_counter()
        used = {d for p in res.best.pipelines for s in p.stages for d in s.group.devices}
        rows.append(
            {
                "seed": seed,
                "devices": cluster.num_devices,
                "nodes": len(cluster.nodes),
                "domains": len(cluster.spec.domains),
                "layers": cluster.model.layers,
                "optimum": opt,
                "ours": res.score.step_time,
                "ratio": res.score.step_time / opt,
                "idle": cluster.num_devices - len(used),
                "schedule": res.best.schedule,
                "optimizer": res.best.optimizer,
                "chunks": res.best.chunks,
                "recompute": any(s.recompute for p in res.best.pipelines for s in p.stages),
                "structures": visited,
                "reference_s": t1 - t0,
                "search_s": t2 - t1,
            }
        )
        r = rows[-1]
        print(
            f"cluster {seed}: {r['devices']} devices, search/optimum {r['ratio']:.4f} ({visited} structures in "
            f"{t1 - t0:.1f} s, search {t2 - t1:.2f} s; {r['idle']} idle, {r['schedule']})",
            flush=True,
        )
        if partial is not None:
            partial.write_text(json.dumps({"rows": rows}, indent=1))
    return rows


def summarize(rows: list[dict]) -> dict:
    ratios = [r["ratio"] for r in rows]
    return {
        "clusters": len(rows),
        "within_1pct": sum(x <= 1 + WITHIN for x in ratios),
        "share_within_1pct": sum(x <= 1 + WITHIN for x in ratios) / len(rows),
        "worst": max(ratios),
        "worst_seed": max(rows, key=lambda r: r["ratio"])["seed"],
        "below_optimum": sum(x < 1 - 1e-9 for x in ratios),
        "optimum_idles_devices": sum(r["idle"] > 0 for r in rows),
        "search_s_total": sum(r["search_s"] for r in rows),
        "search_s_max": max(r["search_s"] for r in rows),
        "reference_s_total": sum(r["reference_s"] for r in rows),
        "structures_median": sorted(r["structures"] for r in rows)[len(rows) // 2],
        "structures_max": max(r["structures"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", type=int, default=200)
    ap.add_argument("--start", type=int, default=0, help="first cluster's seed")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tag", default="", help="suffix of the result files (plan_exhaustive_TAG.*)")
    ap.add_argument(
        "--optima",
        default="",
        help="comma list of earlier plan_exhaustive JSON results (or .partial.json): take the reference optima "
        "from them instead of enumerating again (same generator and cost model only)",
    )
    args = ap.parse_args()
    optima = {r["seed"]: r for f in args.optima.split(",") if f for r in json.loads(Path(f).read_text())["rows"]}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "plan_exhaustive" + (f"_{args.tag}" if args.tag else "")
    partial = out / f"{name}.partial.json"
    load0 = os.getloadavg()
    rows = run(range(args.start, args.start + args.clusters), optima, partial)
    partial.unlink()
    s = summarize(rows)
    met = s["share_within_1pct"] >= TARGET_SHARE and s["worst"] <= TARGET_WORST
    text = (
        f"{s['clusters']} clusters: {s['within_1pct']} ({s['share_within_1pct']:.1%}) within 1% of the optimum, "
        f"worst {s['worst']:.4f}x (cluster {s['worst_seed']}), {s['optimum_idles_devices']} plans leave devices idle; "
        f"search {s['search_s_total']:.1f} s in all (max {s['search_s_max']:.2f} s), reference "
        f"{s['reference_s_total']:.1f} s (median {s['structures_median']} structures, max {s['structures_max']}); "
        f"targets (>= 95% within 1%, none > 1.03x): {'met' if met else 'MISSED'}"
    )
    print(text)
    (out / f"{name}.json").write_text(json.dumps({"summary": s, "rows": rows, "command": " ".join(sys.argv)}, indent=1))
    head = benchlib.report_head(name, benchlib.machine(), load0, os.getloadavg())
    (out / f"{name}.md").write_text("\n".join([*head, text]) + "\n")


if __name__ == "__main__":
    main()
