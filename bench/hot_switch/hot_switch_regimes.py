"""The hot-switching bench's regimes from real hardware and its corpora (``python -m bench.hot_switch.hot_switch``).

**A regime** is a real pairing of a GPU and the link its TP group all-reduces over (and that a switch crosses).
The bench's emulated device is slow (``Config.gflops``, 4 GFLOP/s, so that the real small computation fits inside
each emulated action) and its model is small (hidden 64, float32 activations). It keeps the real **ratio of TP
communication to compute**, not the real speeds: per position and layer at TP 2 the two forward all-reduces move
``2 H b`` bytes per device (ring, ``2 (t-1)/t = 1``) and the forward matmuls are ``24 H^2 / 2`` FLOPs per
device, so

    tp_comm = (2 H b / link) / (12 H^2 / flops) = b flops / (6 H link)

with the real GPU's dense bf16 peak ``flops``, its link's bytes/s ``link``, a 7B-class model's ``H = 4096`` and
bf16 activations (``b = 2``). The bench then sets its emulated TP link so that its own layer has that ratio
(``Config.tp_gbps``), and on the testbed shapes the link between the two emulated nodes to the same rate, so that
switches cross it too.

**Switches** move float32 parameters and gradients (bytes proportional to the parameters ``N``) while a step
computes ``6 N T`` FLOPs for ``T`` tokens: their ratio goes as ``flops / (T link)``, whatever ``H``. Matching
``tp_comm`` (``b flops / (H link)`` equal) makes the bench's ``flops / link`` the real one times
``(b_real H_bench) / (b_bench H_real) = (2 x 64) / (4 x 4096) = 1/128``. Its steps hold ``T = 8 x 512 = 4096``
tokens on two devices, so its switch-to-compute ratio is the real one for ``128 x 4096 = 524 288`` tokens per
step on two GPUs: a Llama-2-style batch of 4M tokens over 16 GPUs. Latencies (gloo's, ~100 us) are not scaled:
they are a larger share of the bench's step than NCCL's are of a real one.

**Memory** is the bench's, not the regime's: a device holds the activations of ``cap_positions`` positions
(half the longest document), HotSPa's premise that the longest sequences do not fit one device without TP,
pipelining or recompute. The planner's memory model gets that cap as the device kind's ``memory_gb``.

**Corpora**: the embedded grammar's documents (lognormal lengths, ``Config.median`` / ``sigma``), and real text:
the first ``TEXT_FILES`` modules of this Python's standard library (``Lib/*.py`` sorted by name) joined by blank
lines, read as ``data.kind = "text"`` (documents split on blank lines, bytes as tokens): code blocks, docstrings
and comments, median ~150 bytes, about 30% over 256 positions holding about 60% of the tokens.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import attrs

REAL_HIDDEN = 4096  # a 7B-class model (Llama-2-7B)
REAL_ACT_BYTES = 2  # bf16 activations
TEXT_FILES = 60


@attrs.frozen
class Regime:
    name: str
    tflops: float  # the GPU's dense bf16 peak (planner/catalogue.py's KINDS)
    link_gbytes: float  # the TP link's bytes/s per direction, in GB/s
    source: str  # where the link figure comes from

    @property
    def tp_comm(self) -> float:
        """TP 2's two forward all-reduces over the forward matmuls of one layer, for the real GPU and model."""
        return REAL_ACT_BYTES * self.tflops * 1e12 / (6 * REAL_HIDDEN * self.link_gbytes * 1e9)

    def derivation(self) -> str:
        return (
            f"{self.name}: {self.tflops:g} TFLOP/s bf16, TP link {self.link_gbytes:g} GB/s ({self.source}); "
            f"tp_comm = 2 x {self.tflops:g}e12 / (6 x {REAL_HIDDEN} x {self.link_gbytes:g}e9) = {self.tp_comm:.3f}"
        )


REGIMES = {
    "a100-nvlink": Regime("A100 TP 2 over NVLink", 312.0, 300.0, "NVLink 3: 600 GB/s both ways, 300 each way"),
    "a100-pcie": Regime("A100 TP 2 over PCIe 4.0 x16", 312.0, 25.0, "32 GB/s peak, ~25 GB/s reached by NCCL"),
    "a100-ib100": Regime(
        "A100 TP 2 across nodes over 100 Gbit/s InfiniBand", 312.0, 12.5, "one 100 Gbit/s HDR100 NIC per GPU"
    ),
    "a100-ib200": Regime(
        "A100 across nodes over 200 Gbit/s InfiniBand",
        312.0,
        25.0,
        "one 200 Gbit/s HDR NIC per GPU, eight a DGX A100 node: HotSPa's and issue 36 5a's cluster",
    ),
    "rtx4090-pcie": Regime(
        "RTX 4090 TP 2 over PCIe 4.0 x16", 165.2, 25.0, "no NVLink or P2P: through host memory, ~25 GB/s at best"
    ),
}


def text_corpus(folder: Path) -> Path:
    """The real-text corpus (see the module doc) written to ``folder/stdlib.txt``; the same bytes on every call."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:TEXT_FILES]
    path = folder / "stdlib.txt"
    path.write_text("\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files), encoding="utf-8")
    return path
