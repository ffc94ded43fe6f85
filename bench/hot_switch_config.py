"""The hot-switching bench's scenario (``python -m bench.hot_switch``, whose docstring explains it): its
configuration and what follows from it: the emulated device, the cluster (loopback or two testbed nodes), the
static and switching layouts, the bucket rows the steps need and the activations a device holds. No
measurement here: ``hot_switch`` runs and measures these layouts.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import attrs

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
    median: float = 48.0
    sigma: float = 1.2
    rounds: int = 2
    gflops: float = 4.0  # the emulated device
    tp_comm: float = 0.5  # TP 2: a layer's forward all-reduces / its forward matmuls
    scenarios: tuple[float, ...] = (0.5, 2.0)  # the tp_comm values run, each a separate comparison
    cap_positions: int = 256  # the memory cap, in positions through every layer per device
    probe_reps: int = 40  # exchanges of each size per link probe
    network: str = "loopback"  # "testbed": the two devices on two emulated nodes joined by a link at the TP link's rate

    @property
    def devices(self) -> tuple[str, str]:
        return ("node0:0", "node1:0") if self.network == "testbed" else ("node0:0", "node0:1")

    @property
    def tp_gbps(self) -> float:
        """The TP link (Gbit/s) for ``tp_comm``: per position and layer at TP 2, the two forward all-reduces move
        2 * (1/2) * hidden * 4 bytes each; the forward matmuls are 24 hidden^2 / 2 FLOPs."""
        matmul_s = 24 * self.hidden ** 2 / 2 / (self.gflops * 1e9)
        return 2 * self.hidden * FLOAT32 / (self.tp_comm * matmul_s) * 8 / 1e9


QUICK = Config(layers=2, hidden=32, heads=4, seq_len=64, global_batch=4, steps=3, warmup=1, short=32, median=8.0,
               rounds=1, gflops=4.0, cap_positions=32, scenarios=(0.5,), probe_reps=5)


def device_spec(cfg: Config) -> str:
    """HETERO_EMULATE_DEVICE's spec: the device's speed and the TP link from ``tp_comm``."""
    return f"gflops={cfg.gflops:g};tp_gbps={cfg.tp_gbps:.6g};tp_latency_us=0"


def cluster_text(cfg: Config) -> str:
    """Loopback: one node of two CPU devices. Testbed: two nodes of one device in one domain whose fabric, and the
    cross-domain one (the default group's: switches), run at the TP link's rate with no added delay."""
    if cfg.network != "testbed":
        return "\n".join(["[[cluster.nodes]]", 'name = "node0"', 'devices = ["cpu", "cpu"]', ""])
    link = [f"bandwidth_gbps = {cfg.tp_gbps:.6g}", "latency_us = 0"]
    return "\n".join(["[[cluster.domains]]", 'name = "d0"', 'kind = "ethernet"', *link, 'gloo_ifname = "dom0"',
                      "[cluster.cross_domain]", *link, 'gloo_ifname = "xdom"',
                      *(line for n in (0, 1) for line in ("[[cluster.nodes]]", f'name = "node{n}"', 'devices = ["cpu"]',
                                                         'domain = "d0"')), ""])


def common(cfg: Config) -> str:
    return "\n".join([
        "[model]", f"layers = {cfg.layers}", f"hidden = {cfg.hidden}", f"heads = {cfg.heads}", "vocab = 64",
        f"seq_len = {cfg.seq_len}",
        "", "[train]", f"steps = {cfg.steps}", f"global_batch = {cfg.global_batch}", "seed = 0", "lr = 1e-3",
        "warmup_steps = 1", "log_every = 1",
        "", "[data]", 'kind = "grammar"', 'packing = "documents"', f"doc_len_median = {cfg.median}",
        f"doc_len_sigma = {cfg.sigma}",
        "", "[cluster]", "timeout_s = 120", cluster_text(cfg)])


def tp2(cfg: Config, batch: int, microbatches: int, prefix: str = "pipelines") -> list[str]:
    return [f"[[{prefix}]]", f"batch = {batch}", f"microbatches = {microbatches}", f"[[{prefix}.stages]]",
            f"layers = {cfg.layers}", f"devices = {json.dumps(list(cfg.devices))}"]


def bucket_rows_needed(cfg: Config) -> tuple[int, int]:
    """(most rows of ``short`` any step's short documents fill, most rows of seq_len its long ones fill)."""
    from hetero_llm import layout as layout_mod
    from hetero_llm.data import documents

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.toml"
        path.write_text(common(cfg) + "\n".join(tp2(cfg, cfg.global_batch, cfg.global_batch)) + "\n")
        lay = layout_mod.load(path)
    source = documents.make_document_source(lay.data, cfg.seq_len, "x")
    short = long_ = 1
    for step in range(cfg.steps):
        docs = documents.fill_documents(source, 0, step, cfg.global_batch, cfg.seq_len)
        for group, width in (([d for d in docs if len(d) - 1 <= cfg.short], cfg.short),
                             ([d for d in docs if len(d) - 1 > cfg.short], cfg.seq_len)):
            if group:
                rows = max(documents.first_fit_decreasing([len(d) for d in group], width)) + 1
                if width == cfg.short:
                    short = max(short, -(-rows // 2))  # per device of DP 2
                else:
                    long_ = max(long_, rows)
    return short, long_


def layout_text(cfg: Config, mode: str, rows: tuple[int, int]) -> str:
    """``static``: TP 2, one row of seq_len per microbatch. ``top-up`` / ``elastic`` / ``fixed``: that as home; short
    documents under DP 2 (one row of ``short`` per microbatch), the rest under TP 2 (one row per microbatch); elastic
    buckets run the microbatches each step needs, fixed ones the most any step needs (``rows``: (short per device,
    long)); ``top-up``: elastic, the long bucket's rows also take short documents into their free positions."""
    lines = tp2(cfg, cfg.global_batch, cfg.global_batch)
    if mode != "static":
        short, long_ = rows if mode == "fixed" else (1, 1)
        elastic = [f"elastic = {str(mode != 'fixed').lower()}"]
        lines += ["", "[[buckets]]", f"max_len = {cfg.short}", *elastic]
        for d in cfg.devices:
            lines += ["[[buckets.pipelines]]", f"batch = {short}", f"microbatches = {short}",
                      "[[buckets.pipelines.stages]]", f"layers = {cfg.layers}", f'devices = ["{d}"]']
        lines += ["", "[[buckets]]", f"max_len = {cfg.seq_len}", *elastic,
                  *(["top_up = true"] if mode == "top-up" else []), *tp2(cfg, long_, long_, "buckets.pipelines")]
    return common(cfg) + "\n".join(lines) + "\n"


LAYOUTS = {"static tp2": "static", "switching dp2/tp2, elastic, top-up": "top-up",
           "switching dp2/tp2, elastic": "elastic", "switching dp2/tp2, fixed": "fixed"}


def activation_positions(cfg: Config, switching: bool) -> int:
    """The most positions through every layer a device holds at once (one microbatch in flight: one stage; one
    row per microbatch in every layout, elastic or not)."""
    if not switching:
        return cfg.seq_len // 2
    return max(cfg.short, cfg.seq_len // 2)
