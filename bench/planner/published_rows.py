"""The published runs bench/planner/published.py checks the cost model against: each row's model, cluster and layout,
built as schema objects and written with the project's TOML writer."""

from __future__ import annotations

from pathlib import Path

import attrs

from hetero_llm import layout as layout_mod
from hetero_llm._fs import write_atomically
from hetero_llm.layout import (
    Backend,
    ClusterSpec,
    DataSpec,
    DomainKind,
    DomainSpec,
    Layout,
    ModelSpec,
    NodeSpec,
    Optimizer,
    PipelineSpec,
    Precision,
    Recompute,
    Schedule,
    StageSpec,
    TrainSpec,
)
from hetero_llm.planner.place import PlaceOptions, pipeline_specs, place


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
    ddp: str = "local"  # run_table_1.sh's DDP: 'torch' overlaps the all-reduce with the backward, 'local' does not

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
    MegatronRow("1.7", 24, 2304, 24, 1, 1, 32, 512, 137.0, 16, ddp="torch"),
    MegatronRow("7.5", 32, 4096, 36, 4, 1, 128, 512, 142.0, 16, ddp="torch"),
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
# How HexiScale counts MFU (its code, github.com/Relaxed-System-Lab/FlashFlex, HexiScale's first name, at a4f366f:
# experimental/cost_modeling.py TimeCost.mfu and glb_flops): 72 L B S H^2 (1 + S/(6H) + V/(16 L H)) FLOPs per step
# (Megatron's formula without the recompute term), over the step time and the sum of every device's peak, from
# experimental/machine_amounts.json: RTX 3080 Ti 56.9, RTX 3090 80, RTX 4090 165.2 TFLOPS.
HEXISCALE_PEAK_TFLOPS = {"rtx3080ti": 56.9, "rtx3090": 80.0, "rtx4090": 165.2}


def hexiscale_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    return 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


HOLMES_NIC_AWARE, HOLMES_DEFAULT = 195.0, 145.0
HOLMES_TP, HOLMES_ROWS_PER_MB = 4, 4


# ------------------------------------------------------------------------------------------
# Cluster files and layouts


def megatron_model(row: MegatronRow) -> ModelSpec:
    return ModelSpec(layers=row.layers, hidden=row.hidden, heads=row.heads, vocab=MEGATRON_VOCAB, seq_len=MEGATRON_SEQ)


def megatron_plan(row: MegatronRow) -> dict:
    """The cluster file's [plan]: DGX nodes of A100 80 GB with eight NICs each, and how Megatron-LM (commit
    6985e58 of examples/sc21) trains: fp16 gradients all-reduced (2 bytes), by torch DDP overlapped with the
    backward where run_table_1.sh says DDP=torch, after it with DDP=local; attention unfused (the scores
    materialized, a fused scale-mask-softmax kernel and dropout); the head split over TP (vocabulary-parallel);
    its hand-fused kernels (bias-GeLU, bias-dropout-add, layer norm) and half-precision weights: ``fused``."""
    return {
        "execution": "fused",
        "grad_bytes": 2,
        "grad_overlap": row.ddp == "torch",
        "attention": "unfused",
        "vocab_parallel": True,
        "nodes": {"dgx*": "a100-80g"},
        "nics": {"dgx*": 8},
    }


def dgx_a100(nodes: int) -> ClusterSpec:
    """``nodes`` DGX A100 80 GB nodes: 8 GPUs on NVLink (the catalogue's a100-80g link), eight 200 Gbit/s HDR
    InfiniBand NICs each (one per GPU: ``[plan.nics]``); the domain's bandwidth is one NIC's."""
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


# What Holmes' repository (github.com/CodexDive/Holmes at 03d9522) says its runs did, for the cluster files' [plan]:
# every example script trains with --fp16 (fp16 gradients: grad_bytes 2) and flash attention, and with
# --use-distributed-optimizer --overlapped-distributed-optimizer (README: "the --use-distributed-optimizer flag to
# enable overlapped distributed optimizer": ZeRO-1 whose gradient reduce-scatter overlaps the backward, Megatron-LLaMA's);
# Megatron's fused kernels (bias-GeLU, bias-dropout-add, layer norm) and vocabulary-parallel head. The NICs per node
# are in the cluster file (its config.json). Figure 6's "Megatron-LM" bar is Megatron-LM itself on the same nodes: its
# defaults of the time (no distributed optimizer, gradients all-reduced after the backward), fp16 like every run there.
HOLMES_PLANS = {
    "holmes": {"execution": "fused", "grad_bytes": 2, "grad_overlap": True, "vocab_parallel": True},
    "megatron": {"execution": "fused", "grad_bytes": 2, "grad_overlap": False, "vocab_parallel": True},
}
HOLMES_OPTIMIZER = {"holmes": Optimizer.ADAMW_ZERO1, "megatron": Optimizer.ADAMW}


def holmes_cluster(cluster_file: Path, framework: str) -> tuple[dict, dict]:
    """The sections of Holmes' cluster file (layouts/clusters/holmes_64gpu.toml) with the framework's optimizer, and
    its [plan] with what the framework did (HOLMES_PLANS)."""
    _, raw, s = layout_mod.read_cluster_file(cluster_file, "bench.planner.published", extra=("plan",))
    s = dict(s, train=attrs.evolve(s["train"], optimizer=HOLMES_OPTIMIZER[framework]))
    return s, {**HOLMES_PLANS[framework], **raw["plan"]}


def holmes_headers(aware: bool, cluster: Path) -> tuple[str, str]:
    """The comments atop the Holmes row's cluster file and layout (Holmes' run, or Figure 6's Megatron-LM bar)."""
    system = (
        "# trained as by Holmes: fp16 gradients reduce-scattered by its overlapped distributed optimizer\n"
        "# (ZeRO-1), overlapped with the last backward"
        if aware
        else "# trained as by Megatron-LM (Holmes' Figure 6 baseline) with its defaults of the time: fp16\n"
        "# gradients all-reduced after the backward, no distributed optimizer"
    )
    cluster_header = (
        "# Holmes (arXiv 2312.03549, Figure 6: parameter group 3, GPT 7.5B on 4 InfiniBand + 4 RoCE nodes of\n"
        "# 8 A100): the nodes and NICs of layouts/clusters/holmes_64gpu.toml,\n" + system + ";\n"
        "# Megatron's fused kernels, flash attention (github.com/CodexDive/Holmes at 03d9522: README, example\n"
        "# scripts, config.json). Written by bench/planner/published.py (python -m bench.planner.published): edit the rows there.\n"
    )
    which = (
        "NIC-aware: hetero-place's placement (DP inside a domain, the pipeline boundary across)"
        if aware
        else "Megatron-LM's default placement: its rank order over hosts alternating IB and RoCE\n"
        "# (each stage's DP group spans both domains; our reading: the figure does not give it)"
    )
    layout_header = (
        f"# Holmes (arXiv 2312.03549), GPT 7.5B on {cluster}.\n"
        f"# {which}.\n"
        f"# TP {HOLMES_TP}, PP 2, DP 8, {HOLMES_ROWS_PER_MB} sequences per microbatch (Holmes' layout is not "
        "published).\n# Written by bench/planner/published.py (python -m bench.planner.published).\n"
    )
    return cluster_header, layout_header


def holmes_layouts(cluster_file: Path, file: str) -> dict[str, Layout]:
    """The NIC-aware layout (hetero-place's) and Megatron's default placement, the same TP, PP, DP and batch."""
    sections = {f: holmes_cluster(cluster_file, f)[0] for f in HOLMES_PLANS}
    s = sections["holmes"]
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
    m = sections["megatron"]
    default = Layout(file, model, m["train"], m["data"], spec, megatron_pipelines(row, hosts))
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

LARGE = 1024  # GPUs: above this the planner gets --budget-large (with 10 s it finds no plan for 2520 GPUs)
