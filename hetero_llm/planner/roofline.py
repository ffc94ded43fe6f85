"""Seconds of one transformer layer (and the head) on one device of a roofline-priced kind. Torch-free.

Each operation the runtime launches is priced on its own (docs/planner.md, "The cost model"):

- a matmul ``(m, k, n)``: ``max(2 m k n / (peak x gemm_fraction x waves), a (m k + k n + m n) / (mem_bw x
  mem_fraction), launch)``. ``waves`` is the tile and wave quantization of its ``m x n`` output cut into
  128 x 128 tiles, one per SM and wave (catalogue.TILE): a small matmul runs below the large-matmul rate.
  Its backward is two matmuls, ``(m, n, k)`` for the input's gradient and ``(k, m, n)`` for the weights'.
- attention: ``flash`` (SDPA, causal: what the runtime runs) ``2 S^2 H / t`` FLOPs per sequence at the
  kind's achieved FlashAttention rate (``attn_fraction``), reading Q, K, V and writing O; its backward 2.5x the FLOPs (it recomputes the scores)
  and twice the bytes. ``unfused`` (Megatron-LM of 2021): two batched matmuls over the full ``S x S``
  scores per head, a softmax kernel and a dropout kernel over them, each priced as above.
- element-wise kernels, memory-bound: the two norms (read H, write H per token), the activation (GELU:
  read and write F / t; SwiGLU: SiLU, then the product), the two residual adds (read 2 H, write H), RoPE on Q
  and K; a backward kernel moves 1.5x its forward's bytes (it reads the input and the output's gradient and
  writes the input's gradient).
- the head: the final norm, the ``(T, H, V / t)`` matmul, the float32 cast and log-softmax of the
  cross-entropy (``a + 12`` bytes per logit forward, ``20 + a`` backward).

``a`` is the activation's bytes (2 in bf16). Every kernel lasts at least its launch (``launch_us``: eager
PyTorch's host launches kernels one by one). A layer's backward does not include recompute (cost.py adds
the forward) nor TP communication (cost.py adds it).
"""

from __future__ import annotations

import functools
import math

from hetero_llm.layout import Mlp, Position
from hetero_llm.planner.catalogue import TILE, DeviceKind

BACKWARD_BYTES = 1.5  # an element-wise backward kernel: reads input and output gradient, writes input gradient
FLASH_BACKWARD_FLOPS = 2.5  # FlashAttention's backward: five matmuls of the forward's two (it recomputes S)


class Roofline:
    """(forward, backward, weight-gradient part) seconds of one layer and of the head, for ``rows`` sequences on
    one device of a TP group of ``tp`` devices of a kind (memoised per kind, rows and TP)."""

    def __init__(self, model, act_bytes: int, attention: str):
        self.m = model
        self.H, self.F, self.S, self.V = model.hidden, model.ffn_width, model.seq_len, model.vocab
        self.heads = model.heads
        self.swiglu = model.mlp is Mlp.SWIGLU
        self.rope = model.position is Position.ROPE
        self.a = act_bytes
        self.flash = attention == "flash"
        self.layer = functools.lru_cache(maxsize=4096)(self._layer)
        self.head = functools.lru_cache(maxsize=4096)(self._head)

    # ---------------------------------------------------------------- one kernel
    @staticmethod
    def waves(k: DeviceKind, batch: int, m: int, n: int) -> float:
        """Useful fraction of the tile slots a (batched) matmul's ``m x n`` outputs take up."""
        if not k.sms:
            return 1.0
        tiles = batch * math.ceil(m / TILE) * math.ceil(n / TILE)
        return batch * m * n / (math.ceil(tiles / k.sms) * k.sms * TILE * TILE)

    def kernel(self, k: DeviceKind, flops: float, nbytes: float, rate: float | None = None) -> float:
        compute = flops / (rate if rate is not None else k.tflops * 1e12 * k.gemm_fraction) if flops else 0.0
        return max(compute, nbytes / (k.mem_bw_gbs * 1e9 * k.mem_fraction), k.launch_us * 1e-6)

    def matmul(self, k: DeviceKind, m: int, kk: int, n: int, batch: int = 1) -> float:
        rate = k.tflops * 1e12 * k.gemm_fraction * self.waves(k, batch, m, n)
        return self.kernel(k, 2.0 * batch * m * kk * n, self.a * batch * (m * kk + kk * n + m * n), rate)

    def linear(self, k: DeviceKind, m: int, kk: int, n: int, batch: int = 1) -> tuple[float, float, float]:
        """(forward, backward, weight gradient) of ``(m, kk) @ (kk, n)``."""
        dw = self.matmul(k, kk, m, n, batch)
        return self.matmul(k, m, kk, n, batch), self.matmul(k, m, n, kk, batch) + dw, dw

    def stream(self, k: DeviceKind, nbytes: float) -> tuple[float, float]:
        """(forward, backward) of one memory-bound element-wise kernel moving ``nbytes`` forward."""
        return self.kernel(k, 0.0, nbytes), self.kernel(k, 0.0, BACKWARD_BYTES * nbytes)

    # ---------------------------------------------------------------- a layer, the head
    def _layer(self, k: DeviceKind, rows: int, tp: int) -> tuple[float, float, float]:
        H, F, S, a, t = self.H, self.F, self.S, self.a, tp
        T = rows * S
        mats = [(T, H, H // t)] * 3 + [(T, H // t, H)] + [(T, H, F // t)] * (2 if self.swiglu else 1) + [(T, F // t, H)]
        fwd = bwd = wgt = 0.0
        for shape in mats:
            f, b, w = self.linear(k, *shape)
            fwd, bwd, wgt = fwd + f, bwd + b, wgt + w
        f, b, w = self.attention(k, rows, t)
        fwd, bwd, wgt = fwd + f, bwd + b, wgt + w
        streams = [2 * a * H * T] * 2 + [3 * a * H * T] * 2  # norms, residual adds
        streams += [2 * a * F // t * T, 3 * a * F // t * T] if self.swiglu else [2 * a * F // t * T]
        if self.rope:
            streams.append(2 * a * 2 * H // t * T)
        for nbytes in streams:
            f, b = self.stream(k, nbytes)
            fwd, bwd = fwd + f, bwd + b
        return fwd, bwd, wgt

    def attention(self, k: DeviceKind, rows: int, t: int) -> tuple[float, float, float]:
        H, S, a = self.H, self.S, self.a
        if self.flash:
            flops = rows * 2.0 * S * S * H / t
            nbytes = a * 4 * rows * S * H / t
            rate = k.tflops * 1e12 * (k.attn_fraction or k.gemm_fraction)
            fwd = self.kernel(k, flops, nbytes, rate)
            return fwd, self.kernel(k, FLASH_BACKWARD_FLOPS * flops, 2 * nbytes, rate), 0.0
        heads, d = self.heads // t, H // self.heads
        batch = rows * heads
        f1, b1, _ = self.linear(k, S, d, S, batch)  # Q K^T (the weight-gradient split does not apply)
        f2, b2, _ = self.linear(k, S, S, d, batch)  # probabilities x V
        scores = batch * S * S
        fs, bs = self.stream(k, 2 * a * scores)  # scale, mask and softmax in one kernel
        fd, bd = self.stream(k, (2 * a + 1) * scores)  # dropout: read, write, write the mask
        return f1 + f2 + fs + fd, b1 + b2 + bs + bd, 0.0

    def _head(self, k: DeviceKind, rows: int, tp: int) -> tuple[float, float, float]:
        T, H, a = rows * self.S, self.H, self.a
        vocab = self.V / tp
        f, b, w = self.linear(k, T, H, math.ceil(vocab))
        nf, nb = self.stream(k, 2 * a * H * T)  # the final norm
        ce_f = self.kernel(k, 0.0, (a + 4) * vocab * T) + self.kernel(k, 0.0, 8 * vocab * T)
        ce_b = self.kernel(k, 0.0, 4 * vocab * T) + self.kernel(k, 0.0, 12 * vocab * T)
        ce_b += self.kernel(k, 0.0, (4 + a) * vocab * T)
        return f + nf + ce_f, b + nb + ce_b, w
