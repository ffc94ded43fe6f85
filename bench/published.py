"""The planner's cost model against published training measurements: is it one a user can plan with?

    python -m bench.published            # every row (a few minutes: the largest cluster has 2520 GPUs)
    python -m bench.published --quick    # the small clusters only (the test suite runs this)

For each published run, the cost model's prediction for the run's own layout (``hetero_llm.planner.evaluate``,
what ``hetero-plan CLUSTER --evaluate LAYOUT`` prints), converted to the publication's own way of counting
FLOPs, next to the published number; and, on each cluster, the planner's own pick (``plan_cluster``, with a
small search budget) against the published layout's prediction. Nothing here runs a model, and nothing is
fitted: the cost model prices every device at its catalogue (datasheet) peak.

The rows:

- **Megatron-LM weak scaling** (Narayanan et al., SC'21, Table 1): DGX A100 80 GB nodes, 8 GPUs per node on
  NVLink, InfiniBand between nodes; GPT, vocabulary 51 200, sequence 2048, full recompute; TP inside a node,
  PP across nodes, DP across pipelines, in Megatron's rank order (TP fastest, then DP, then PP). Micro-batch
  sizes and the interleaved schedule's layers per virtual stage are those of Megatron-LM's
  ``examples/sc21/run_table_1.sh``. "Achieved TFLOP/s per GPU" counts
  ``96 B s l h^2 (1 + s / (6 h) + V / (16 l h))`` FLOPs per step (forward, backward and the recomputed forward).
- **HexiScale** (arXiv 2409.01143): 31.19% MFU on its 40-GPU cluster with its own planned layout. That layout is
  not published: the layout evaluated is our planner's plan for layouts/clusters/hexiscale_40gpu.toml (so it
  checks the model's MFU level, not a layout), MFU counted as the cost model counts it.
- **Holmes** (arXiv 2312.03549, README figure): GPT 7.5B on 4 InfiniBand + 4 RoCE nodes of 8 A100,
  ~195 TFLOP/s per GPU with NIC-aware groups, ~145 with Megatron-LM's default placement; counted with Megatron's
  formula. The layout is not published: TP 4 (Megatron's for this model), one pipeline stage per NIC domain
  (PP 2), DP 8, 4 rows per microbatch; NIC-aware = ``hetero-place``'s placement; default = Megatron's rank
  order over a host list alternating the two domains, so each stage's DP group spans both.
- **One H100** (a plain PyTorch loop, bf16): GPT 1.3B at sequence 2048 and GPT 124M at 1024, eager and
  ``torch.compile``; MFU counted as nanoGPT does, ``(6 N + 12 l h s)`` FLOPs per token over 989 TFLOP/s.

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

from bench import benchlib
from hetero_llm import layout as layout_mod
from hetero_llm._fs import write_atomically
from hetero_llm.errors import LayoutError
from hetero_llm.layout import (
    Backend,
    ClusterSpec,
    DataSpec,
    DomainKind,
    DomainSpec,
    Layout,
    ModelSpec,
    NodeSpec,
    PipelineSpec,
    Precision,
    Recompute,
    Schedule,
    StageSpec,
    TrainSpec,
)
from hetero_llm.planner import plan_cluster
from hetero_llm.planner.cluster import Cluster, load_cluster
from hetero_llm.planner.evaluate import Evaluation, evaluate
from hetero_llm.planner.output import planned_layout
from hetero_llm.planner.place import PlaceOptions, pipeline_specs, place

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = Path("layouts/clusters/published")  # under --files-dir (the repository root by default)
LAYOUTS = Path("layouts/papers/published")
WITHIN = 0.15  # a prediction a user can plan with is within 15% of the measurement

A100_PEAK = 312e12  # bf16/fp16 dense, the peak Megatron-LM and Holmes quote
H100_PEAK = 989e12


# ------------------------------------------------------------------------------------------
# The published rows


@attrs.frozen
class MegatronRow:
    """One row of Megatron-LM's weak-scaling table, with its micro-batch size and interleaving."""

    params_b: str  # billions, as the paper names the model
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    tflops: float  # published achieved TFLOP/s per GPU
    micro_batch: int  # run_table_1.sh's MBS
    layers_per_chunk: int = 0  # --num-layers-per-virtual-pipeline-stage; 0: not interleaved

    @property
    def name(self) -> str:
        return f"megatron_{self.params_b}b"

    @property
    def nodes(self) -> int:
        return self.gpus // 8

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def chunks(self) -> int:
        return self.layers // self.pp // self.layers_per_chunk if self.layers_per_chunk else 1


MEGATRON_VOCAB, MEGATRON_SEQ = 51_200, 2048
MEGATRON = (
    MegatronRow("1.7", 24, 2304, 24, 1, 1, 32, 512, 137.0, 16),
    MegatronRow("7.5", 32, 4096, 36, 4, 1, 128, 512, 142.0, 16),
    MegatronRow("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138.0, 4),
    MegatronRow("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148.0, 2, 5),
    MegatronRow("529.6", 128, 20480, 105, 8, 35, 2520, 2520, 163.0, 1, 1),
)
QUICK_MEGATRON = ("1.7",)


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one step as Megatron-LM counts them (forward, backward and the recomputed forward)."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


@attrs.frozen
class H100Row:
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    global_batch: int  # not published: a batch that fits (the prediction barely depends on it)
    microbatches: int
    eager_mfu: float
    compiled_mfu: float
    eager_tokens_s: float
    compiled_tokens_s: float


GPT2_VOCAB = 50_257
H100 = (
    H100Row("h100_gpt_1.3b", 24, 2048, 16, 2048, 32, 4, 0.47, 0.55, 51_500, 59_700),
    H100Row("h100_gpt_124m", 12, 768, 12, 1024, 32, 2, 0.25, 0.40, 289_000, 459_000),
)


def nanogpt_flops_per_token(layers: int, hidden: int, seq: int, vocab: int) -> float:
    """nanoGPT's MFU numerator per token: 6 N + 12 l h s, N the parameters without the position embedding
    (taken as 12 l h^2 + V h: the weight matrices and the tied embedding; biases and norms, <0.2%, left out)."""
    n = 12 * layers * hidden**2 + vocab * hidden
    return 6 * n + 12 * layers * hidden * seq


HEXISCALE_MFU = 0.3119
HOLMES_NIC_AWARE, HOLMES_DEFAULT = 195.0, 145.0
HOLMES_TP, HOLMES_ROWS_PER_MB = 4, 4


# ------------------------------------------------------------------------------------------
# Cluster files and layouts


def megatron_model(row: MegatronRow) -> ModelSpec:
    return ModelSpec(layers=row.layers, hidden=row.hidden, heads=row.heads, vocab=MEGATRON_VOCAB, seq_len=MEGATRON_SEQ)


def dgx_a100(nodes: int) -> ClusterSpec:
    """``nodes`` DGX A100 80 GB nodes: 8 GPUs on NVLink (the catalogue's a100-80g link), one 200 Gbit/s HDR
    InfiniBand NIC per node (the cluster file's unit: a DGX has eight, the cost model shares one per node)."""
    return ClusterSpec(
        nodes=tuple(
            NodeSpec(name=f"dgx{i}", host=f"dgx{i}", devices=tuple(f"cuda:{d}" for d in range(8)), domain="ib")
            for i in range(nodes)
        ),
        backend=Backend.NCCL,
        domains=(DomainSpec(name="ib", kind=DomainKind.IB, bandwidth_gbps=200.0, latency_us=2.0),),
    )


def megatron_train(row: MegatronRow) -> TrainSpec:
    return TrainSpec(
        steps=10,
        global_batch=row.global_batch,
        schedule=Schedule.INTERLEAVED if row.layers_per_chunk else Schedule.ONE_F_ONE_B,
        chunks=row.chunks,
        precision=Precision.BF16,
        recompute=Recompute.FULL,
    )


def megatron_sections(row: MegatronRow) -> dict:
    return {
        "model": megatron_model(row),
        "train": megatron_train(row),
        "data": DataSpec(),
        "cluster": dgx_a100(row.nodes),
    }


def megatron_pipelines(row: MegatronRow, hosts: list[str], gpus_per_node: int = 8) -> tuple[PipelineSpec, ...]:
    """Megatron-LM's rank order: rank = pp x (DP x TP) + dp x TP + tp, ranks numbered along ``hosts``; pipeline
    ``dp`` is the ranks with that dp index, each stage its TP group (inside a node when TP divides 8)."""

    def device(rank: int) -> str:
        return f"{hosts[rank // gpus_per_node]}:{rank % gpus_per_node}"

    per_stage = row.layers // row.pp
    batch = row.global_batch // row.dp
    return tuple(
        PipelineSpec(
            batch=batch,
            microbatches=batch // row.micro_batch,
            stages=tuple(
                StageSpec(
                    layers=per_stage,
                    devices=tuple(device(pp * row.dp * row.tp + dp * row.tp + t) for t in range(row.tp)),
                )
                for pp in range(row.pp)
            ),
        )
        for dp in range(row.dp)
    )


def megatron_layout(row: MegatronRow, file: str) -> Layout:
    s = megatron_sections(row)
    hosts = [n.name for n in s["cluster"].nodes]
    return Layout(file, s["model"], s["train"], s["data"], s["cluster"], megatron_pipelines(row, hosts))


def h100_model(row: H100Row) -> ModelSpec:
    return ModelSpec(
        layers=row.layers,
        hidden=row.hidden,
        heads=row.heads,
        vocab=GPT2_VOCAB,
        seq_len=row.seq,
        tie_embeddings=True,
        bias=True,
    )


def h100_sections(row: H100Row) -> dict:
    cluster = ClusterSpec(nodes=(NodeSpec(name="h100", host="h100", devices=("cuda:0",)),), backend=Backend.NCCL)
    train = TrainSpec(steps=10, global_batch=row.global_batch, precision=Precision.BF16)
    return {"model": h100_model(row), "train": train, "data": DataSpec(), "cluster": cluster}


def h100_layout(row: H100Row, file: str) -> Layout:
    s = h100_sections(row)
    pipe = PipelineSpec(
        batch=row.global_batch,
        microbatches=row.microbatches,
        stages=(StageSpec(layers=row.layers, devices=("h100:0",)),),
    )
    return Layout(file, s["model"], s["train"], s["data"], s["cluster"], (pipe,))


def holmes_layouts(cluster_file: Path, file: str) -> dict[str, Layout]:
    """The NIC-aware layout (hetero-place's) and Megatron's default placement, the same TP, PP, DP and batch."""
    _, _, s = layout_mod.read_cluster_file(cluster_file, "bench.published", extra=("plan",))
    model, train, spec = s["model"], s["train"], s["cluster"]
    pp = len(spec.domains)
    dp = len(spec.nodes) * 8 // (HOLMES_TP * pp)
    microbatches = train.global_batch // dp // HOLMES_ROWS_PER_MB
    placed = place(str(cluster_file), model, train, spec, PlaceOptions(tp=HOLMES_TP, microbatches=microbatches))
    aware = Layout(file, model, train, s["data"], spec, pipeline_specs(placed))
    # Megatron's default: ranks in host order, the hosts alternating the domains (ib0, roce0, ib1, roce1, ...)
    by_domain = [[n.name for n in spec.nodes if n.domain == d.name] for d in spec.domains]
    hosts = [h for pair in zip(*by_domain) for h in pair]
    row = MegatronRow(
        "7.5",
        model.heads,
        model.hidden,
        model.layers,
        HOLMES_TP,
        pp,
        dp * HOLMES_TP * pp,
        train.global_batch,
        HOLMES_DEFAULT,
        HOLMES_ROWS_PER_MB,
    )
    default = Layout(file, model, train, s["data"], spec, megatron_pipelines(row, hosts))
    return {"holmes_nic_aware": aware, "holmes_default": default}


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda f: f.write(text.encode("utf-8")))


def write_cluster(path: Path, sections: dict, plan: dict, header: str) -> None:
    write_text(path, layout_mod.dumps_cluster(sections, {"plan": plan}, header=header))


def write_layout(path: Path, lay: Layout, header: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    layout_mod.dump(attrs.evolve(lay, file=str(path)), path, header=header)


# ------------------------------------------------------------------------------------------
# Predictions


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
    nics: int = 0  # NICs a node really has, where the cluster file's one NIC per node stands for several


def tflops_per_gpu(flops: float, gpus: int) -> Callable[[Evaluation, float], float]:
    """The publication's FLOPs per step over the step time, per GPU."""
    return lambda ev, step: flops / step / gpus / 1e12


def nanogpt_mfu(row: H100Row) -> Callable[[Evaluation, float], float]:
    per_token = nanogpt_flops_per_token(row.layers, row.hidden, row.seq, GPT2_VOCAB)
    return lambda ev, step: per_token * row.global_batch * row.seq / step / H100_PEAK


def model_mfu(ev: Evaluation, step: float) -> float:
    """MFU as the cost model counts it (its model FLOPs over every device's catalogue peak)."""
    return ev.score.mfu * ev.score.step_time / step


def build_files(root: Path, quick: bool, budget: float) -> tuple[list[Case], dict[Path, dict]]:
    """Write every cluster file and published layout under ``root``; the cases that read them, and the planner
    runs made on the way (HexiScale's layout is the planner's pick), by cluster file."""
    cases: list[Case] = []
    megatron_plan = {"nodes": {"dgx*": "a100-80g"}}
    for row in MEGATRON:
        if quick and row.params_b not in QUICK_MEGATRON:
            continue
        cpath, lpath = CLUSTERS / f"{row.name}.toml", LAYOUTS / f"{row.name}.toml"
        what = (
            f"# Megatron-LM weak scaling, GPT {row.params_b}B (Narayanan et al., SC'21, Table 1), on {row.nodes} DGX A100\n"
            f"# 80 GB nodes ({row.gpus} GPUs, one 200 Gbit/s InfiniBand NIC per node in this file: a DGX has eight).\n"
        )
        write_cluster(
            root / cpath,
            megatron_sections(row),
            megatron_plan,
            what + "# Written by bench/published.py (python -m bench.published): edit the rows there.\n",
        )
        sched = f"interleaved x{row.chunks} chunks" if row.layers_per_chunk else "1f1b"
        write_layout(
            root / lpath,
            megatron_layout(row, str(lpath)),
            what
            + f"# The published layout: TP {row.tp} inside a node, PP {row.pp} across nodes, DP {row.dp} (Megatron-LM's "
            f"rank order),\n# {row.micro_batch} sequences per microbatch, {sched}, full recompute.\n"
            "# Written by bench/published.py (python -m bench.published).\n",
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
                nics=8,
            )
        )
    for row in H100:
        cpath, lpath = CLUSTERS / f"{row.name}.toml", LAYOUTS / f"{row.name}.toml"
        size = row.name.rsplit("_", 1)[1].upper()
        what = f"One H100 80 GB (SXM), GPT {size} (GPT-2 shapes), sequence {row.seq}, bf16"
        write_cluster(
            root / cpath,
            h100_sections(row),
            {"nodes": {"h100": "h100-sxm"}},
            f"# {what}.\n# Written by bench/published.py (python -m bench.published): edit the rows there.\n",
        )
        write_layout(
            root / lpath,
            h100_layout(row, str(lpath)),
            f"# {what}: one stage, {row.global_batch} sequences per step in {row.microbatches} microbatches (the\n"
            "# measured loop's batch is not published). Written by bench/published.py (python -m bench.published).\n",
        )
        for mode, mfu in (("eager", row.eager_mfu), ("compiled", row.compiled_mfu)):
            cases.append(
                Case(
                    f"{row.name}_{mode}",
                    f"H100, GPT {size} seq {row.seq}, {mode}",
                    root / cpath,
                    root / lpath,
                    "MFU (nanoGPT)",
                    mfu,
                    nanogpt_mfu(row),
                )
            )
    holmes_cluster = Path("layouts/clusters/holmes_64gpu.toml")
    for name, lay in holmes_layouts(ROOT / holmes_cluster, "x.toml").items():
        m = lay.model
        hflops = megatron_flops(lay.train.global_batch, m.seq_len, m.layers, m.hidden, m.vocab)
        lpath = LAYOUTS / f"{name}.toml"
        which = (
            "NIC-aware: hetero-place's placement (DP inside a domain, the pipeline boundary across)"
            if name == "holmes_nic_aware"
            else "Megatron-LM's default placement: its rank order over hosts alternating IB and RoCE\n"
            "# (each stage's DP group spans both domains)"
        )
        write_layout(
            root / lpath,
            lay,
            "# Holmes (arXiv 2312.03549), GPT 7.5B on layouts/clusters/holmes_64gpu.toml.\n"
            f"# {which}.\n"
            f"# TP {HOLMES_TP}, PP 2, DP 8, {HOLMES_ROWS_PER_MB} sequences per microbatch (Holmes' layout is not "
            "published).\n# Written by bench/published.py (python -m bench.published).\n",
        )
        published = HOLMES_NIC_AWARE if name == "holmes_nic_aware" else HOLMES_DEFAULT
        cases.append(
            Case(
                name,
                "Holmes GPT 7.5B, " + ("NIC-aware" if name == "holmes_nic_aware" else "default placement"),
                ROOT / holmes_cluster,
                root / lpath,
                "TFLOP/s per GPU",
                published,
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
            "# Written by bench/published.py (python -m bench.published).\n",
        )
        cases.append(
            Case(
                "hexiscale",
                "HexiScale Llama-2 7B, 40 GPUs (our plan)",
                ROOT / hexi,
                root / lpath,
                "MFU (cost model's)",
                HEXISCALE_MFU,
                model_mfu,
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


def with_nics(cluster: Cluster, nics: int) -> Cluster:
    """The cluster with each node's ``nics`` NICs taken as one NIC ``nics`` times as fast (a what-if of the input:
    the cost model shares one NIC per node)."""
    net = cluster.network
    return attrs.evolve(cluster, network=attrs.evolve(net, domain_bw=tuple((d, bw * nics) for d, bw in net.domain_bw)))


LARGE = 1024  # GPUs: above this the planner gets --budget-large (with 10 s it finds no plan for 2520 GPUs)


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
        nics = None
        if case.nics:
            nics = case.value(ev, unchecked_step(evaluate(with_nics(cluster, case.nics), lay, str(case.layout))))
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
                "predicted_all_nics": nics,
                "nics_per_node": case.nics or None,
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


def summary(cand) -> str:
    from hetero_llm.planner.output import summary as plan_summary

    tp = "/".join(sorted({str(s.group.tp) for p in cand.pipelines for s in p.stages}, key=int))
    rc = sum(s.recompute for p in cand.pipelines for s in p.stages)
    stages = sum(len(p.stages) for p in cand.pipelines)
    return f"{plan_summary(cand)}, TP {tp}, rows/mb {cand.pipelines[0].rows}, recompute {rc}/{stages} stages"


# ------------------------------------------------------------------------------------------
# Report


ROW_COLUMNS = ["row", "GPUs", "metric", "published", "predicted", "predicted/published", "within 15%"]
WHAT_IF_COLUMNS = ["row", "predicted", "sync hidden", "all NICs", "step s", "bubble", "TP s", "sync s", "optimizer s"]
DETAIL_COLUMNS = ["layout", "fullest stage GB", "of usable GB", "load s"]
PICK_COLUMNS = [
    "cluster",
    "published layout",
    "its step s",
    "pick's step s",
    "pick/published",
    "planner's pick",
    "plan s",
]


def num(v, digits: int = 4) -> str:
    return "n/a" if v is None else f"{v:.{digits}g}"


def report(rows: list[dict], picks: list[dict], info: dict) -> str:
    table = benchlib.markdown_table(
        ROW_COLUMNS,
        [
            [
                r["row"],
                str(r["gpus"]),
                r["metric"],
                num(r["published"]),
                num(r["predicted"]) + ("" if r["fits"] else " (does not fit)"),
                f"{r['ratio']:.2f}",
                "yes" if r["within_15pct"] else "no",
            ]
            for r in rows
        ],
    )
    what_if = benchlib.markdown_table(
        WHAT_IF_COLUMNS,
        [
            [
                r["row"],
                num(r["predicted"]),
                num(r["predicted_sync_hidden"]),
                num(r["predicted_all_nics"]),
                num(r["step_time_s"]),
                f"{r['bubble']:.1%}",
                num(r["tp_s"], 3),
                num(r["sync_s"], 3),
                num(r["optimizer_s"], 3),
            ]
            for r in rows
        ],
    )
    layouts: dict[str, dict] = {}
    for r in rows:
        layouts.setdefault(r["layout"], r)
    detail = benchlib.markdown_table(
        DETAIL_COLUMNS,
        [
            [
                name,
                num(r["memory_gb"], 3),
                num(r["usable_memory_gb"], 3),
                f"{r['load_cluster_s']:.2f} + {r['load_layout_s']:.2f}",
            ]
            for name, r in layouts.items()
        ],
    )
    pick_table = benchlib.markdown_table(
        PICK_COLUMNS,
        [
            [
                p["cluster"],
                p["layout"],
                num(p["published_layout_step_s"]),
                num(p["pick_step_s"]),
                num(p["pick_over_published"], 3),
                p["pick"],
                f"{p['plan_s']:.1f}",
            ]
            for p in picks
        ],
    )
    return "\n".join(
        [
            "# Cost model vs published measurements",
            "",
            f"Command: `{info['command']}`: {info['seconds']:.0f} s on {benchlib.machine_line(info['machine'])};",
            f"{benchlib.load_line(info['load_before'], info['load_after'])}. Planner budget {info['budget']:g} s per "
            f"cluster ({info['budget_large']:g} s above {LARGE} GPUs).",
            "",
            "Predicted: the cost model's step time for the published layout (`hetero-plan CLUSTER --evaluate LAYOUT`),",
            "converted to the publication's own FLOP counting. Nothing is measured on this machine.",
            "",
            table,
            "",
            "What the predictions are made of. *sync hidden*: the same prediction with the gradient sync fully",
            "overlapped (step - sync); *all NICs*: with each DGX node's 8 InfiniBand NICs taken as one NIC 8 times",
            "as fast (the cluster file has one NIC per node); step s is the predicted step (for a layout that does",
            "not fit in memory, what it would take if it did).",
            "",
            what_if,
            "",
            "Memory per device of each published layout's fullest stage (against its memory) as the cost model",
            "counts it, and the seconds to load the cluster file + the layout:",
            "",
            detail,
            "",
            "The planner's own pick on each cluster (`plan_cluster`), against the published layout's prediction:",
            "",
            pick_table,
            "",
        ]
    )


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
