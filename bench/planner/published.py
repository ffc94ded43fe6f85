"""The planner's cost model against published training measurements: is it one a user can plan with?

    python -m bench.planner.published            # every row (a few minutes: the largest cluster has 2520 GPUs)
    python -m bench.planner.published --quick    # the small clusters only (the test suite runs this)

For each published run, the cost model's prediction for the run's own layout (``hetero_llm.planner.evaluate``,
what ``hetero-plan CLUSTER --evaluate LAYOUT`` prints), converted to the publication's own way of counting
FLOPs, next to the published number; and, on each cluster, the planner's own pick (``plan_cluster``, with a
small search budget) against the published layout's prediction. Nothing here runs a model. The cost model is
the roofline one over the device catalogue (hetero_llm/planner/catalogue.py): one constant there is calibrated,
the GPUs' sustained fraction, on the Megatron 1.7B row, which therefore checks nothing; the "uncalibrated"
column gives every row without it.

The rows:

- **Megatron-LM weak scaling** (Narayanan et al., SC'21, Table 1): DGX A100 80 GB nodes, 8 GPUs per node on
  NVLink, InfiniBand between nodes; GPT, vocabulary 51 200, sequence 2048, full recompute; TP inside a node,
  PP across nodes, DP across pipelines, in Megatron's rank order (TP fastest, then DP, then PP). Micro-batch
  sizes and the interleaved schedule's layers per virtual stage are those of Megatron-LM's
  ``examples/sc21/run_table_1.sh``. "Achieved TFLOP/s per GPU" counts
  ``96 B s l h^2 (1 + s / (6 h) + V / (16 l h))`` FLOPs per step (forward, backward and the recomputed forward).
  The cluster files' ``[plan]`` says how Megatron-LM trained (``published_rows.megatron_plan``): 8 NICs per
  node, fp16 gradients, torch DDP's overlap where the script uses it, unfused attention, a vocabulary-parallel
  embedding and head, its hand-fused element-wise kernels (``execution = "fused"``).
- **HexiScale** (arXiv 2409.01143): 31.19% MFU on its 40-GPU cluster with its own planned layout. That layout is
  not published: the layout evaluated is our planner's plan for layouts/clusters/hexiscale_40gpu.toml (so it
  checks the model's MFU level, not a layout), MFU counted as HexiScale's code counts it
  (``published_rows.HEXISCALE_PEAK_TFLOPS``: Megatron's formula without recompute over its own device peaks).
- **Holmes** (arXiv 2312.03549, Figure 6 in its repository's README): GPT 7.5B on 4 InfiniBand + 4 RoCE nodes of
  8 A100, ~195 TFLOP/s per GPU with Holmes, ~145 with Megatron-LM on the same nodes; counted with Megatron's
  formula (the figure's samples/s agree with it: ~95 and ~71). The layout is not published: TP 4 (Megatron's for
  this model), one pipeline stage per NIC domain (PP 2), DP 8, 4 rows per microbatch (the repository's example
  scripts' micro-batch size); Holmes = ``hetero-place``'s NIC-aware placement; Megatron-LM = its rank order over
  a host list alternating the two domains, so each stage's DP group spans both (our reading). The cluster files
  (``published_rows.HOLMES_PLANS``) say what the repository says the runs did: 4 NICs per InfiniBand node and 2
  per RoCE node, fp16 gradients, Holmes' overlapped distributed optimizer (ZeRO-1, reduce-scatter overlapping
  the backward) and Megatron-LM's defaults of the time for its bar.
- **One H100** (a plain PyTorch loop, bf16): GPT 1.3B at sequence 2048 and GPT 124M at 1024, eager and
  ``torch.compile``, each with its cluster file (``plan.execution``); MFU counted as nanoGPT does,
  ``(6 N + 12 l h s)`` FLOPs per token over 989 TFLOP/s.

The bench writes the cluster files (``layouts/clusters/published/``) and the published layouts
(``layouts/papers/published/``) from these rows (``--files-dir`` puts them elsewhere), loads them back as a user's
files are loaded (timing that: the largest is 315 nodes), and writes bench/results/published.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from bench.common import benchlib
from bench.planner.published_report import report, summary
from bench.planner.published_rows import (
    GPT2_VOCAB,
    H100,
    HEXISCALE_MFU,
    HEXISCALE_PEAK_TFLOPS,
    HOLMES_DEFAULT,
    HOLMES_NIC_AWARE,
    LARGE,
    MEGATRON,
    MEGATRON_SEQ,
    MEGATRON_VOCAB,
    QUICK_MEGATRON,
    H100Row,
    h100_layout,
    h100_sections,
    hexiscale_flops,
    holmes_cluster,
    holmes_headers,
    holmes_layouts,
    megatron_flops,
    megatron_layout,
    megatron_plan,
    megatron_sections,
    nanogpt_flops_per_token,
    write_cluster,
    write_layout,
)
from hetero_llm import layout as layout_mod
from hetero_llm.errors import LayoutError
from hetero_llm.planner import catalogue, plan_cluster
from hetero_llm.planner.cluster import Cluster, load_cluster
from hetero_llm.planner.evaluate import Evaluation, evaluate
from hetero_llm.planner.output import planned_layout

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = Path("layouts/clusters/published")  # under --files-dir (the repository root by default)
LAYOUTS = Path("layouts/papers/published")
WITHIN = 0.15  # a prediction a user can plan with is within 15% of the measurement

A100_PEAK = 312e12  # bf16/fp16 dense, the peak Megatron-LM and Holmes quote
H100_PEAK = 989e12


# ------------------------------------------------------------------------------------------
# The published rows


@attrs.frozen
class Case:
    """One published number, and how to read the same quantity off a predicted step time."""

    name: str
    source: str
    cluster: Path  # the cluster file and the layout file (absolute)
    layout: Path
    metric: str
    published: float
    value: Callable[[Evaluation, float], float]  # the metric for a predicted step of that many seconds
    published_flops: float = 0.0  # per step, the publication's counting (0: not a FLOP metric)


def tflops_per_gpu(flops: float, gpus: int) -> Callable[[Evaluation, float], float]:
    """The publication's FLOPs per step over the step time, per GPU."""
    return lambda ev, step: flops / step / gpus / 1e12


def nanogpt_mfu(row: H100Row) -> Callable[[Evaluation, float], float]:
    per_token = nanogpt_flops_per_token(row.layers, row.hidden, row.seq, GPT2_VOCAB)
    return lambda ev, step: per_token * row.global_batch * row.seq / step / H100_PEAK


def hexiscale_mfu(cluster: Cluster) -> Callable[[Evaluation, float], float]:
    """MFU as HexiScale counts it (``published_rows.HEXISCALE_PEAK_TFLOPS``): its FLOPs per step over the step and
    the sum of its peaks for every device of the cluster, idle ones included."""
    m = cluster.model
    flops = hexiscale_flops(cluster.train.global_batch, m.seq_len, m.layers, m.hidden, m.vocab)
    peak = sum(n.devices * HEXISCALE_PEAK_TFLOPS[n.kind.name] for n in cluster.nodes) * 1e12
    return lambda ev, step: flops / step / peak


def build_files(root: Path, quick: bool, budget: float) -> tuple[list[Case], dict[Path, dict]]:
    """Write every cluster file and published layout under ``root``; the cases that read them, and the planner
    runs made on the way (HexiScale's layout is the planner's pick), by cluster file."""
    cases: list[Case] = []
    for row in MEGATRON:
        if quick and row.params_b not in QUICK_MEGATRON:
            continue
        cpath, lpath = CLUSTERS / f"{row.name}.toml", LAYOUTS / f"{row.name}.toml"
        what = (
            f"# Megatron-LM weak scaling, GPT {row.params_b}B (Narayanan et al., SC'21, Table 1), on {row.nodes} DGX A100\n"
            f"# 80 GB nodes ({row.gpus} GPUs, eight 200 Gbit/s HDR InfiniBand NICs per node), as Megatron-LM ran in 2021:\n"
            f"# fp16 gradients all-reduced ({'torch DDP, overlapped with the backward' if row.ddp == 'torch' else 'local DDP, after the backward'}),\n"
            "# attention unfused (the S x S scores materialized).\n"
        )
        write_cluster(
            root / cpath,
            megatron_sections(row),
            megatron_plan(row),
            what
            + "# Written by bench/planner/published.py (python -m bench.planner.published): edit the rows there.\n",
        )
        sched = f"interleaved x{row.chunks} chunks" if row.layers_per_chunk else "1f1b"
        write_layout(
            root / lpath,
            megatron_layout(row, str(lpath)),
            what
            + f"# The published layout: TP {row.tp} inside a node, PP {row.pp} across nodes, DP {row.dp} (Megatron-LM's "
            f"rank order),\n# {row.micro_batch} sequences per microbatch, {sched}, full recompute.\n"
            "# Written by bench/planner/published.py (python -m bench.planner.published).\n",
        )
        flops = megatron_flops(row.global_batch, MEGATRON_SEQ, row.layers, row.hidden, MEGATRON_VOCAB)
        cases.append(
            Case(
                row.name,
                f"Megatron-LM {row.params_b}B, TP {row.tp} PP {row.pp} DP {row.dp}",
                root / cpath,
                root / lpath,
                "TFLOP/s per GPU",
                row.tflops,
                tflops_per_gpu(flops, row.gpus),
                flops,
            )
        )
    for row in H100:
        lpath = LAYOUTS / f"{row.name}.toml"
        size = row.name.rsplit("_", 1)[1].upper()
        what = f"One H100 80 GB (SXM), GPT {size} (GPT-2 shapes), sequence {row.seq}, bf16"
        for mode in ("eager", "compiled"):
            write_cluster(
                root / CLUSTERS / f"{row.name}_{mode}.toml",
                h100_sections(row),
                {"execution": mode, "nodes": {"h100": "h100-sxm"}},
                f"# {what}, a plain PyTorch loop run {mode}"
                f"{' (torch.compile of the model)' if mode == 'compiled' else ''}.\n"
                "# Written by bench/planner/published.py (python -m bench.planner.published): edit the rows there.\n",
            )
        write_layout(
            root / lpath,
            h100_layout(row, str(lpath)),
            f"# {what}: one stage, {row.global_batch} sequences per step in {row.microbatches} microbatches (the\n"
            "# measured loop's batch is not published). Written by bench/planner/published.py (python -m bench.planner.published).\n",
        )
        for mode, mfu in (("eager", row.eager_mfu), ("compiled", row.compiled_mfu)):
            cases.append(
                Case(
                    f"{row.name}_{mode}",
                    f"H100, GPT {size} seq {row.seq}, {mode}",
                    root / CLUSTERS / f"{row.name}_{mode}.toml",
                    root / lpath,
                    "MFU (nanoGPT)",
                    mfu,
                    nanogpt_mfu(row),
                )
            )
    holmes_file = ROOT / "layouts/clusters/holmes_64gpu.toml"
    for name, lay in holmes_layouts(holmes_file, "x.toml").items():
        m = lay.model
        hflops = megatron_flops(lay.train.global_batch, m.seq_len, m.layers, m.hidden, m.vocab)
        aware = name == "holmes_nic_aware"
        framework = "holmes" if aware else "megatron"
        cpath = CLUSTERS / ("holmes_7.5b.toml" if aware else "holmes_megatron_7.5b.toml")
        lpath = LAYOUTS / f"{name}.toml"
        sections, plan_table = holmes_cluster(holmes_file, framework)
        cluster_header, layout_header = holmes_headers(aware, cpath)
        write_cluster(root / cpath, sections, plan_table, cluster_header)
        write_layout(root / lpath, lay, layout_header)
        cases.append(
            Case(
                name,
                "Holmes GPT 7.5B, " + ("Holmes (NIC-aware)" if aware else "Megatron-LM"),
                root / cpath,
                root / lpath,
                "TFLOP/s per GPU",
                HOLMES_NIC_AWARE if aware else HOLMES_DEFAULT,
                tflops_per_gpu(hflops, 64),
                hflops,
            )
        )
    plans: dict[Path, dict] = {}
    if not quick:
        hexi = Path("layouts/clusters/hexiscale_40gpu.toml")
        cluster = load_cluster(ROOT / hexi)
        got = plans[ROOT / hexi] = plan(cluster, budget)
        result = got["result"]  # the planner finds a plan for this cluster
        lpath = LAYOUTS / "hexiscale_planned.toml"
        write_layout(
            root / lpath,
            planned_layout(cluster, result.best),
            "# HexiScale (arXiv 2409.01143) publishes 31.19% MFU with its own planned layout, which is not public:\n"
            f"# this is hetero-plan's plan for {hexi} (plan_cluster, budget {budget:g} s).\n"
            "# Written by bench/planner/published.py (python -m bench.planner.published).\n",
        )
        cases.append(
            Case(
                "hexiscale",
                "HexiScale Llama-2 7B, 40 GPUs (our plan)",
                ROOT / hexi,
                root / lpath,
                "MFU (HexiScale's count)",
                HEXISCALE_MFU,
                hexiscale_mfu(cluster),
            )
        )
    return cases, plans


def rel(path: Path, root: Path) -> str:
    for base in (root, ROOT):
        try:
            return str(path.resolve().relative_to(base.resolve()))
        except ValueError:
            continue
    return str(path)


def unchecked_step(ev: Evaluation) -> float:
    """The predicted step time, also for a layout that does not fit in memory (whose score's step is inf)."""
    s = ev.score
    return s.step_time if s.feasible else max(s.pipeline_times) + s.sync_time + s.optimizer_time


def uncalibrated(cluster: Cluster) -> Cluster | None:
    """The cluster with the catalogue's calibrated constant (``sustained``) left out of every kind, or None when
    no kind of it has one: what the model predicts from its sources alone."""
    nodes, changed = [], False
    for n in cluster.nodes:
        spec = catalogue.KINDS.get(n.kind.name)
        if spec is None or spec.sustained == 1.0:
            nodes.append(n)
            continue
        k, s = n.kind, spec.sustained
        kind = attrs.evolve(
            k, gemm_fraction=k.gemm_fraction / s, attn_fraction=k.attn_fraction / s, mem_fraction=k.mem_fraction / s
        )
        nodes.append(attrs.evolve(n, kind=kind))
        changed = True
    return attrs.evolve(cluster, nodes=tuple(nodes)) if changed else None


def plan(cluster: Cluster, budget: float) -> dict:
    """The planner's pick on ``cluster`` within ``budget`` seconds (or why there is none)."""
    t0 = time.perf_counter()
    try:
        result = plan_cluster(cluster, top=1, budget_s=budget)
    except LayoutError as e:  # (the file's name is in the table already)
        return {"plan_s": time.perf_counter() - t0, "error": f"{e.path}: {e.message}"}
    return {"plan_s": time.perf_counter() - t0, "result": result}


def predict(
    cases: list[Case], root: Path, budget: float, budget_large: float, plans: dict[Path, dict]
) -> tuple[list[dict], list[dict]]:
    """Each case's prediction (one row each), and per cluster the planner's pick against its published layouts
    (``plans``: picks already made, by cluster file)."""
    rows: list[dict] = []
    loaded: dict[Path, tuple[Cluster, float]] = {}
    evaluations: dict[tuple[Path, Path], Evaluation] = {}
    for case in cases:
        if case.cluster not in loaded:
            t0 = time.perf_counter()
            loaded[case.cluster] = (load_cluster(case.cluster), time.perf_counter() - t0)
        cluster, cluster_s = loaded[case.cluster]
        t0 = time.perf_counter()
        lay = layout_mod.load(case.layout)
        layout_s = time.perf_counter() - t0
        ev = evaluations.get((case.cluster, case.layout))
        if ev is None:
            ev = evaluations[(case.cluster, case.layout)] = evaluate(cluster, lay, str(case.layout))
        s = ev.score
        worst = s.worst_memory()
        step = unchecked_step(ev)
        predicted = case.value(ev, step)
        raw_cluster = uncalibrated(cluster)
        raw = None
        if raw_cluster is not None:
            raw = case.value(ev, unchecked_step(evaluate(raw_cluster, lay, str(case.layout))))
        rows.append(
            {
                "row": case.name,
                "source": case.source,
                "cluster": rel(case.cluster, root),
                "layout": rel(case.layout, root),
                "gpus": ev.devices,
                "metric": case.metric,
                "published": case.published,
                "predicted": predicted,  # for a layout that does not fit: its step time had it fit
                "ratio": predicted / case.published,
                "within_15pct": s.feasible and abs(predicted / case.published - 1) <= WITHIN,
                "fits": s.feasible,
                "predicted_sync_hidden": case.value(ev, step - s.sync_time),
                "predicted_uncalibrated": raw,  # None: no calibrated constant in this cluster's kinds
                "published_flops_per_step": case.published_flops or None,
                "step_time_s": step,
                "tokens_per_s": s.tokens_per_s * s.step_time / step if s.feasible else None,
                "bubble": s.bubble,
                "tp_s": s.tp_time,
                "sync_s": s.sync_time,
                "optimizer_s": s.optimizer_time,
                "compute_bound_s": s.lower_bound,
                # the stage furthest over (or nearest to) its memory: bytes per device, and what it may use
                "memory_gb": s.memory[worst[0]][worst[1]] / 1e9,
                "usable_memory_gb": s.capacity[worst[0]][worst[1]] / 1e9,
                "load_cluster_s": cluster_s,
                "load_layout_s": layout_s,
            }
        )
        benchlib.say(f"{case.name}: published {case.published:g}, predicted {predicted:.4g} ({case.metric})")
    picks: list[dict] = []
    for path, (cluster, _) in loaded.items():
        got = plans.get(path) or plan(cluster, budget_large if cluster.num_devices > LARGE else budget)
        result = got.get("result")
        for (cpath, lpath), ev in evaluations.items():
            if cpath != path:
                continue
            published = ev.score.step_time
            pick = result.score.step_time if result else None
            picks.append(
                {
                    "cluster": rel(path, root),
                    "layout": rel(lpath, root),
                    "published_layout_step_s": published if ev.score.feasible else None,
                    "pick_step_s": pick,
                    "pick_over_published": pick / published if pick and ev.score.feasible else None,
                    "pick_at_least_as_fast": pick is not None and pick <= published * (1 + 1e-9),
                    "pick": summary(result.best) if result else "none: " + got["error"],
                    "plan_s": got["plan_s"],
                    "budget_s": budget_large if cluster.num_devices > LARGE else budget,
                    "evaluated": result.evaluated if result else None,
                }
            )
        benchlib.say(f"planned {rel(path, root)} in {got['plan_s']:.1f} s: {picks[-1]['pick']}")
    return rows, picks


# ------------------------------------------------------------------------------------------
# Report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small clusters only (for the test suite)")
    ap.add_argument("--budget", type=float, default=10.0, help="the planner's search budget per cluster, seconds")
    ap.add_argument(
        "--budget-large", type=float, default=60.0, help=f"the budget on clusters of more than {LARGE} GPUs, seconds"
    )
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument(
        "--files-dir",
        default=str(ROOT),
        help="where layouts/clusters/published/ and layouts/papers/published/ are written (the repository root)",
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    root = Path(args.files_dir)
    cases, plans = build_files(root, args.quick, args.budget)
    rows, picks = predict(cases, root, args.budget, args.budget_large, plans)
    info = {
        "command": benchlib.command_line(),
        "machine": benchlib.machine(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "budget": args.budget,
        "budget_large": args.budget_large,
        "seconds": time.perf_counter() - t0,
        "quick": args.quick,
    }
    text = report(rows, picks, info)
    print(text)
    benchlib.write_results(Path(args.out_dir), "published", text, {**info, "results": rows, "picks": picks})


if __name__ == "__main__":
    main()
