"""The hot-switching bench's scenario (``python -m bench.hot_switch.hot_switch``, whose docstring explains it): its
configuration and what follows from it: the emulated device (from a real-hardware regime,
``hot_switch_regimes.py``), the corpus, the cluster (loopback or two testbed nodes), the hand-made switching
layouts, the bucket rows the steps need and the activations a device holds. The static layouts are the planner's
(``hot_switch_static.py``). No measurement here: ``hot_switch`` runs and measures these layouts.
"""

from __future__ import annotations

import attrs

from bench.hot_switch.hot_switch_regimes import REGIMES
from hetero_llm import layout as layout_mod
from hetero_llm.layout import (
    BucketSpec,
    ClusterSpec,
    CrossDomainSpec,
    DataKind,
    DataSpec,
    DomainKind,
    DomainSpec,
    Layout,
    ModelSpec,
    NodeSpec,
    Packing,
    PipelineSpec,
    StageSpec,
    TrainSpec,
)

FLOAT32 = 4


@attrs.frozen
class Config:
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    seq_len: int = 512
    global_batch: int = 8
    steps: int = 6
    warmup: int = 2
    short: int = 256  # the DP bucket's max_len
    short_dp: int = 128  # the no-recompute DP bucket's max_len (recompute_layout)
    median: float = 48.0
    sigma: float = 1.2
    rounds: int = 2
    gflops: float = 4.0  # the emulated device
    regime: str = "a100-ib100"  # hot_switch_regimes.REGIMES: the real GPU and TP link whose tp_comm this run keeps
    regimes: tuple[str, ...] = ("a100-nvlink", "a100-pcie", "a100-ib100")  # the regimes run, each a comparison
    corpus: str = "grammar"  # "grammar" (embedded) or "text" (hot_switch_regimes.text_corpus at text_path)
    corpora: tuple[str, ...] = ("grammar", "text")
    text_path: str = ""
    cap_positions: int = 256  # the memory cap, in positions through every layer per device
    static_candidates: int = 3  # the planner's best predicted static layouts measured
    probe_reps: int = 40  # exchanges of each size per link probe
    probe_host_reps: int = 15  # rounds of a step's switches per host-work probe (hot_switch_probes.host_costs)
    switching_only: bool = False  # run the switching layouts only (their switch times), not the static ones
    hand: bool = True  # run the hand-made switching layouts (switch_layout, recompute_layout)
    run_rejected: bool = False  # also run the buckets --buckets priced and rejected (hot_switch_static)
    max_cp: int = 1  # the planner's plan.max_cp for the static layouts and --buckets (2: CP allowed, issue 36 5b)
    network: str = "loopback"  # "testbed": the two devices on two emulated nodes joined by a link at the TP link's rate

    @property
    def tp_comm(self) -> float:
        """TP 2: a layer's forward all-reduces / its forward matmuls, the regime's (hot_switch_regimes)."""
        return REGIMES[self.regime].tp_comm

    @property
    def vocab(self) -> int:
        return 256 if self.corpus == "text" else 64  # bytes as tokens for text

    @property
    def devices(self) -> tuple[str, str]:
        return ("node0:0", "node1:0") if self.network == "testbed" else ("node0:0", "node0:1")

    @property
    def tp_gbps(self) -> float:
        """The TP link (Gbit/s) for ``tp_comm``: per position and layer at TP 2, the two forward all-reduces move
        2 * (1/2) * hidden * 4 bytes each; the forward matmuls are 24 hidden^2 / 2 FLOPs."""
        matmul_s = 24 * self.hidden**2 / 2 / (self.gflops * 1e9)
        return 2 * self.hidden * FLOAT32 / (self.tp_comm * matmul_s) * 8 / 1e9


QUICK = Config(
    layers=2,
    hidden=32,
    heads=4,
    seq_len=64,
    global_batch=4,
    steps=3,
    warmup=1,
    short=32,
    short_dp=16,
    median=8.0,
    rounds=1,
    gflops=4.0,
    cap_positions=32,
    regime="a100-pcie",
    regimes=("a100-pcie",),
    corpora=("grammar",),
    static_candidates=2,
    probe_reps=5,
    probe_host_reps=3,
)


def device_spec(cfg: Config) -> str:
    """HETERO_EMULATE_DEVICE's spec: the device's speed and the TP link from ``tp_comm``."""
    return f"gflops={cfg.gflops:g};tp_gbps={cfg.tp_gbps:.6g};tp_latency_us=0"


def cluster(cfg: Config) -> ClusterSpec:
    """Loopback: one node of two CPU devices. Testbed: two nodes of one device in one domain whose fabric, and the
    cross-domain one (the default group's: switches), run at the TP link's rate with no added delay."""
    if cfg.network != "testbed":
        return ClusterSpec(nodes=(NodeSpec(name="node0", devices=("cpu", "cpu")),), timeout_s=120.0)
    gbps = float(f"{cfg.tp_gbps:.6g}")  # as device_spec gives it
    domain = DomainSpec(name="d0", kind=DomainKind.ETHERNET, bandwidth_gbps=gbps, latency_us=0.0, gloo_ifname="dom0")
    nodes = tuple(NodeSpec(name=f"node{n}", devices=("cpu",), domain="d0") for n in (0, 1))
    return ClusterSpec(
        nodes=nodes,
        timeout_s=120.0,
        domains=(domain,),
        cross_domain=CrossDomainSpec(bandwidth_gbps=gbps, latency_us=0.0, gloo_ifname="xdom"),
    )


def common(cfg: Config, pipelines: tuple[PipelineSpec, ...], buckets: tuple[BucketSpec, ...] = ()) -> Layout:
    """The scenario's model, training, documents and cluster, with these pipelines and buckets."""
    model = ModelSpec(layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, vocab=cfg.vocab, seq_len=cfg.seq_len)
    train = TrainSpec(steps=cfg.steps, global_batch=cfg.global_batch, seed=0, lr=1e-3, warmup_steps=1, log_every=1)
    if cfg.corpus == "text":
        data = DataSpec(kind=DataKind.TEXT, path=cfg.text_path, packing=Packing.DOCUMENTS)
    else:
        data = DataSpec(packing=Packing.DOCUMENTS, doc_len_median=float(cfg.median), doc_len_sigma=float(cfg.sigma))
    return Layout(
        file="<hot_switch>",
        model=model,
        train=train,
        data=data,
        cluster=cluster(cfg),
        pipelines=pipelines,
        buckets=buckets,
    )


def tp2(cfg: Config, batch: int, microbatches: int) -> PipelineSpec:
    return PipelineSpec(
        batch=batch, microbatches=microbatches, stages=(StageSpec(layers=cfg.layers, devices=cfg.devices),)
    )


def bucket_rows_needed(cfg: Config) -> tuple[int, int]:
    """(most rows of ``short`` any step's short documents fill, most rows of seq_len its long ones fill)."""
    from hetero_llm.data import documents, sources

    lay = layout_mod.loads(layout_mod.dumps(common(cfg, (tp2(cfg, cfg.global_batch, cfg.global_batch),))), "x.toml")
    source = sources.make_document_source(lay.data, cfg.seq_len, "x")
    short = long_ = 1
    for step in range(cfg.steps):
        docs = documents.fill_documents(source, 0, step, cfg.global_batch, cfg.seq_len)
        for group, width in (
            ([d for d in docs if len(d) - 1 <= cfg.short], cfg.short),
            ([d for d in docs if len(d) - 1 > cfg.short], cfg.seq_len),
        ):
            if group:
                rows = max(documents.first_fit_decreasing([len(d) for d in group], width)) + 1
                if width == cfg.short:
                    short = max(short, -(-rows // 2))  # per device of DP 2
                else:
                    long_ = max(long_, rows)
    return short, long_


def switch_layout(cfg: Config, mode: str, rows: tuple[int, int]) -> Layout:
    """``static``: TP 2, one row of seq_len per microbatch. ``top-up`` / ``elastic`` / ``fixed``: that as home; short
    documents under DP 2 (one row of ``short`` per microbatch), the rest under TP 2 (one row per microbatch); elastic
    buckets run the microbatches each step needs, fixed ones the most any step needs (``rows``: (short per device,
    long)); ``top-up``: elastic, the long bucket's rows also take short documents into their free positions."""
    home = (tp2(cfg, cfg.global_batch, cfg.global_batch),)
    if mode == "static":
        return common(cfg, home)
    short, long_ = rows if mode == "fixed" else (1, 1)
    elastic = mode != "fixed"
    dp2 = tuple(
        PipelineSpec(batch=short, microbatches=short, stages=(StageSpec(layers=cfg.layers, devices=(d,)),))
        for d in cfg.devices
    )
    return common(
        cfg,
        home,
        (
            BucketSpec(max_len=cfg.short, elastic=elastic, pipelines=dp2),
            BucketSpec(
                max_len=cfg.seq_len, elastic=elastic, top_up=mode == "top-up", pipelines=(tp2(cfg, long_, long_),)
            ),
        ),
    )


def recompute_layout(cfg: Config) -> Layout:
    """Switching against a data-parallel baseline that recomputes: home DP 2 with full recompute, one row per
    microbatch; documents of 1-``short_dp`` positions under DP 2 *without* recompute (one row of ``short_dp`` per
    microbatch: what the cap allows, its parameter storage counted), the rest under home's stages as an elastic bucket
    (one row per microbatch, recompute, topped up). What switching can win here is the recomputed forward of the
    short documents."""
    from hetero_llm.layout import Recompute

    def dp2(rows: int, recompute: bool) -> tuple[PipelineSpec, ...]:
        rc = Recompute.FULL if recompute else None
        return tuple(
            PipelineSpec(
                batch=rows, microbatches=rows, stages=(StageSpec(layers=cfg.layers, devices=(d,), recompute=rc),)
            )
            for d in cfg.devices
        )

    return common(
        cfg,
        dp2(cfg.global_batch // 2, True),
        (
            BucketSpec(max_len=cfg.short_dp, elastic=True, pipelines=dp2(1, False)),
            BucketSpec(max_len=cfg.seq_len, elastic=True, top_up=True, pipelines=dp2(1, True)),
        ),
    )


def layout_text(cfg: Config, mode: str, rows: tuple[int, int]) -> str:
    """``switch_layout``'s TOML text."""
    return layout_mod.dumps(switch_layout(cfg, mode, rows))
