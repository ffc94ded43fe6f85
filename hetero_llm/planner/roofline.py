"""Seconds of one transformer layer (and the head) on one device of a roofline-priced kind. Torch-free.

Each kernel is priced on its own (docs/planner.md, "The cost model"):

- a matmul ``(m, k, n)``: ``max(2 m k n / (peak x gemm_fraction x waves), a (m k + k n + m n) / (mem_bw x
  mem_fraction))``. ``waves`` is the tile and wave quantization of its ``m x n`` output cut into
  128 x 128 tiles, one per SM and wave (catalogue.TILE): a small matmul runs below the large-matmul rate.
  Its backward is two matmuls, ``(m, n, k)`` for the input's gradient and ``(k, m, n)`` for the weights'.
- attention: ``flash`` (SDPA, causal: what the runtime runs) ``2 Q H / t`` FLOPs per sequence at the
  kind's achieved FlashAttention rate (``attn_fraction``), reading Q, K, V and writing O; its backward 2.5x the FLOPs (it recomputes the scores)
  and twice the bytes. ``Q`` is a row's sum of squared document lengths (``square``: ``S^2``, one document
  per row, unless ``[plan.documents]`` declares the corpus: planner/documents.py). With context parallelism
  (``cp``) a device holds ``1 / cp`` of every row's tokens and computes ``1 / cp`` of its attention (the
  load-balanced ring: each rank's query chunks meet every key chunk once); ring traffic is cost.py's. ``unfused`` (Megatron-LM of 2021): two batched matmuls over the full ``S x S``
  scores per head, a softmax kernel and a dropout kernel over them, each priced as above.
- the memory-bound work, by how it runs (``plan.execution``):
  ``eager`` (the runtime): one kernel per op ``model.block`` dispatches (tests/unit/test_cost_roofline.py traces
  them): the two norms, the projections' bias adds, the activation, the two residual adds, RoPE's products,
  sums and stack; in backward each one's (1.5x the bytes: it reads the input and the output's gradient and
  writes the input's gradient; a bias's gradient is one read; a residual add's none), the residual stream's two
  gradient accumulations and the fused projections' output gradients concatenated; in bf16 the per-microbatch
  cast of every float32 weight (read 4, write 2 bytes per element), the concatenations that make Q K V (and the
  MLP's input projections) one GEMM, and in backward each gradient's cast and accumulation into the float32
  ``.grad`` (18 bytes). The host launches the ops one by one (``EAGER_DISPATCH_US`` + ``launch_us`` per
  forward op, ``launch_us`` per backward kernel), ahead of the GPU: a layer takes the larger of its kernels'
  sum and its host time.
  ``compiled`` (torch.compile, the whole model): each chain of element-wise ops between two matmuls is one
  kernel reading its inputs and writing its outputs once: residual add + bias + norm (twice), bias + RoPE of
  Q K V, bias + activation; backward 1.5x; the weight casts as eager (they are in the graph; cast and
  concatenation one kernel); the cross-entropy one kernel (two passes over the bf16 logits forward, read and
  write backward); ``launch_us`` of host time per kernel.
  ``fused`` (Megatron-LM's hand-fused kernels): one kernel per norm, per residual (bias-dropout-add) and for
  the activation (bias-GeLU), no weight casts (half-precision weights); every kernel lasts at least its launch.
- the head: the final norm, the ``(T, H, V / t)`` matmul, the float32 cast and log-softmax of the
  cross-entropy (``a + 12`` bytes per logit forward, ``20 + a`` backward) unless compiled.

``a`` is the activation's bytes (2 in bf16). A layer's backward does not include recompute (cost.py adds
the forward) nor TP communication (cost.py adds it).
"""

from __future__ import annotations

import functools
import math

from hetero_llm.layout import Mlp, Norm, Position
from hetero_llm.planner.catalogue import EAGER_DISPATCH_US, TILE, DeviceKind

BACKWARD_BYTES = 1.5  # an element-wise backward kernel: reads input and output gradient, writes input gradient
FLASH_BACKWARD_FLOPS = 2.5  # FlashAttention's backward: five matmuls of the forward's two (it recomputes S)
EAGER, COMPILED, FUSED = "eager", "compiled", "fused"
CAST_BYTES, GRAD_CAST_BYTES = 6, 18  # float32 -> bf16 weight copy; bf16 grad -> float32, accumulated into .grad


class Tally:
    """The kernels of one pass (a layer's forward or backward): GPU seconds of each, and their count."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def add(self, seconds: float, kernels: int = 1) -> None:
        self.times += [seconds] + [0.0] * (kernels - 1)

    def seconds(self, k: DeviceKind, mode: str, forward: bool) -> float:
        """``fused``: each kernel at least its launch; ``eager`` and ``compiled``: the host launches the kernels
        ahead of the GPU, so the pass takes the larger of their sum and the host's time."""
        launch = k.launch_us * 1e-6
        if mode == FUSED:
            return sum(max(t, launch) for t in self.times)
        host = launch + (EAGER_DISPATCH_US * 1e-6 if mode == EAGER and forward else 0.0)
        return max(sum(self.times), len(self.times) * host)


class Roofline:
    """(forward, backward, weight-gradient part) seconds of one layer and of the head, for ``rows`` sequences on
    one device of a TP group of ``tp`` devices of a kind, 1 / ``cp`` of their tokens (memoised per kind, rows,
    TP and CP). ``mode`` and
    ``head_mode``: how the layers' and the head's element-wise work runs (EAGER, COMPILED or FUSED)."""

    def __init__(
        self,
        model,
        act_bytes: int,
        attention: str,
        mode: str = FUSED,
        head_mode: str = FUSED,
        square: float | None = None,
    ):
        self.m = model
        self.H, self.F, self.S, self.V = model.hidden, model.ffn_width, model.seq_len, model.vocab
        # a row's sum of squared document lengths (flash attention's work): S^2 unless documents are declared
        self.square = float(self.S) * self.S if square is None else square
        self.heads = model.heads
        self.swiglu = model.mlp is Mlp.SWIGLU
        self.rope = model.position is Position.ROPE
        self.bias = model.bias
        self.norm_params = 2 if model.norm is Norm.LAYERNORM else 1
        self.a = act_bytes
        self.flash = attention == "flash"
        self.mode, self.head_mode = mode, head_mode
        self.casts = act_bytes < 4 and mode != FUSED  # bf16 copies of the float32 master weights, per microbatch
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

    def gpu(self, k: DeviceKind, flops: float, nbytes: float, rate: float | None = None) -> float:
        """GPU seconds of one kernel: the larger of its FLOPs at ``rate`` and its bytes at the copy bandwidth."""
        compute = flops / (rate if rate is not None else k.tflops * 1e12 * k.gemm_fraction) if flops else 0.0
        return max(compute, nbytes / (k.mem_bw_gbs * 1e9 * k.mem_fraction))

    def kernel(self, k: DeviceKind, flops: float, nbytes: float, rate: float | None = None) -> float:
        """One kernel that lasts at least its launch."""
        return max(self.gpu(k, flops, nbytes, rate), k.launch_us * 1e-6)

    def matmul_gpu(self, k: DeviceKind, m: int, kk: int, n: int, batch: int = 1) -> float:
        rate = k.tflops * 1e12 * k.gemm_fraction * self.waves(k, batch, m, n)
        return self.gpu(k, 2.0 * batch * m * kk * n, self.a * batch * (m * kk + kk * n + m * n), rate)

    def matmul(self, k: DeviceKind, m: int, kk: int, n: int, batch: int = 1) -> float:
        return max(self.matmul_gpu(k, m, kk, n, batch), k.launch_us * 1e-6)

    def linear(self, k: DeviceKind, fwd: Tally, bwd: Tally, m: int, kk: int, n: int, batch: int = 1) -> float:
        """Adds ``(m, kk) @ (kk, n)`` and its backward's two matmuls; returns the weight gradient's seconds."""
        dw = self.matmul_gpu(k, kk, m, n, batch)
        fwd.add(self.matmul_gpu(k, m, kk, n, batch))
        bwd.add(self.matmul_gpu(k, m, n, kk, batch))
        bwd.add(dw)
        return max(dw, k.launch_us * 1e-6)

    def stream(self, k: DeviceKind, fwd: Tally, bwd: Tally, nbytes: float, back: float = BACKWARD_BYTES) -> None:
        """One memory-bound element-wise kernel moving ``nbytes`` forward, and its backward (``back`` x the bytes)."""
        fwd.add(self.gpu(k, 0.0, nbytes))
        if back:
            bwd.add(self.gpu(k, 0.0, back * nbytes))

    def weight_casts(self, k: DeviceKind, fwd: Tally, bwd: Tally, tp: int) -> None:
        """The per-microbatch bf16 copies of the float32 weights (eager: each a kernel, then the Q K V and the MLP's
        input projections concatenated into one GEMM's weight; compiled: cast and concatenation fused) and,
        backward, each gradient's cast and its accumulation into ``.grad``; the norms' and biases' too (tiny)."""
        if not self.casts:
            return
        H, F, nm = self.H, self.F, 2 if self.swiglu else 1
        for n in [H * H / tp] * 4 + [H * F / tp] * (nm + 1):
            self.stream(k, fwd, bwd, CAST_BYTES * n, GRAD_CAST_BYTES / CAST_BYTES)
            bwd.add(0.0)  # the accumulation's kernel (its bytes are in GRAD_CAST_BYTES)
        if self.mode == EAGER:
            for n in (3 * H * H / tp, nm * H * F / tp):  # torch.cat of the cast weights: read and write bf16
                fwd.add(self.gpu(k, 0.0, 2 * self.a * n))
        small = 2 * self.norm_params + (5 + nm if self.bias else 0)
        fwd.add(0.0, small)
        bwd.add(0.0, 2 * small)

    def eager_elementwise(self, k: DeviceKind, fwd: Tally, bwd: Tally, T: int, t: int) -> None:
        """The element-wise kernels of ``model.block`` as eager PyTorch runs them (counted from its dispatched ops)."""
        H, F, a, nm = self.H, self.F, self.a, 2 if self.swiglu else 1
        for nbytes in [2 * a * H * T] * 2:  # the norms
            self.stream(k, fwd, bwd, nbytes)
        for nbytes in [3 * a * H * T] * 2:  # the residual adds (their backward passes the gradient on: no kernel)
            self.stream(k, fwd, bwd, nbytes, 0.0)
        for nbytes in [2 * a * F // t * T, 3 * a * F // t * T] if self.swiglu else [2 * a * F // t * T]:
            self.stream(k, fwd, bwd, nbytes)
        if self.rope:  # rope_tables' 9 tiny kernels; _apply_rope on Q and K: 4 muls, a sub, an add, a stack each
            fwd.add(0.0, 9)
            for _ in range(14):
                self.stream(k, fwd, bwd, 18 * a * H / t * T / 14)
        for w in [H // t] * 3 + [H] + [F // t] * nm + [H] if self.bias else []:
            self.stream(k, fwd, bwd, 2 * a * w * T, 0.5)  # a bias add; its gradient reads the output's once
        for nbytes in [3 * a * H * T] * 2:  # the residual stream's gradient, accumulated where it forks
            bwd.add(self.gpu(k, 0.0, nbytes))
        if self.casts:  # the fused projections' output gradients concatenated (the split's backward)
            gathers = [2 * a * 3 * H // t * T, 2 * a * nm * F // t * T]
        else:  # the separate projections' input gradients summed
            gathers = [3 * a * H * T] * (2 + nm - 1)
        for nbytes in gathers:
            bwd.add(self.gpu(k, 0.0, nbytes))

    # ---------------------------------------------------------------- a layer, the head
    def tallies(self, k: DeviceKind, rows: int, tp: int, cp: int = 1) -> tuple[Tally, Tally, float]:
        """The kernels of one layer's forward and backward, and the seconds of its weight gradients."""
        H, F, a, t = self.H, self.F, self.a, tp
        T = rows * self.S // cp
        nm = 2 if self.swiglu else 1
        fwd, bwd = Tally(), Tally()
        if self.casts:  # the runtime casts its weights anyway, and runs Q K V (and w1, w3) as one GEMM
            mats = [(T, H, 3 * H // t), (T, H // t, H), (T, H, nm * F // t), (T, F // t, H)]
        else:
            mats = [(T, H, H // t)] * 3 + [(T, H // t, H)] + [(T, H, F // t)] * nm + [(T, F // t, H)]
        wgt = sum(self.linear(k, fwd, bwd, *shape) for shape in mats)
        f, b = self.attention(k, rows, t, cp)
        fwd.add(f)
        bwd.add(b)
        if self.mode == EAGER:
            self.eager_elementwise(k, fwd, bwd, T, t)
        else:
            if self.mode == COMPILED:
                streams = [4 * a * H * T] * 2  # (residual add, bias, norm) twice
                if self.bias or self.rope:
                    streams.append(2 * a * 3 * H // t * T)  # Q K V: bias, RoPE
                streams.append(3 * a * F // t * T if self.swiglu else 2 * a * F // t * T)  # bias + activation
            else:  # norms, residual adds (bias-dropout-add), activation (bias-GeLU), RoPE
                streams = [2 * a * H * T] * 2 + [3 * a * H * T] * 2
                streams += [2 * a * F // t * T, 3 * a * F // t * T] if self.swiglu else [2 * a * F // t * T]
                streams += [2 * a * 2 * H // t * T] if self.rope else []
            for nbytes in streams:
                self.stream(k, fwd, bwd, nbytes)
        self.weight_casts(k, fwd, bwd, t)
        return fwd, bwd, wgt

    def _layer(self, k: DeviceKind, rows: int, tp: int, cp: int = 1) -> tuple[float, float, float]:
        fwd, bwd, wgt = self.tallies(k, rows, tp, cp)
        fs, bs = fwd.seconds(k, self.mode, True), bwd.seconds(k, self.mode, False)
        return fs, bs, min(wgt, bs)

    def attention(self, k: DeviceKind, rows: int, t: int, cp: int = 1) -> tuple[float, float]:
        """(forward, backward) GPU seconds of the attention (with CP: one device's ``1 / cp`` of it, over its
        ring steps; unfused attention does not take CP)."""
        H, S, a = self.H, self.S, self.a
        if self.flash:
            flops = rows * 2.0 * self.square * H / t / cp
            # each ring step reads the device's Q and O chunks and one K, V chunk: Q K V O of a row in all
            nbytes = a * 4 * rows * S * H / t
            rate = k.tflops * 1e12 * (k.attn_fraction or k.gemm_fraction)
            return self.kernel(k, flops, nbytes, rate), self.kernel(k, FLASH_BACKWARD_FLOPS * flops, 2 * nbytes, rate)
        heads, d = self.heads // t, H // self.heads
        batch = rows * heads
        f, b = Tally(), Tally()
        self.linear(k, f, b, S, d, S, batch)  # Q K^T (the weight-gradient split does not apply)
        self.linear(k, f, b, S, S, d, batch)  # probabilities x V
        scores = batch * S * S
        self.stream(k, f, b, 2 * a * scores)  # scale, mask and softmax in one kernel
        self.stream(k, f, b, (2 * a + 1) * scores)  # dropout: read, write, write the mask
        return f.seconds(k, FUSED, True), b.seconds(k, FUSED, False)

    def _head(self, k: DeviceKind, rows: int, tp: int, cp: int = 1) -> tuple[float, float, float]:
        T, H, a = rows * self.S // cp, self.H, self.a
        vocab = self.V / tp
        fwd, bwd = Tally(), Tally()
        w = self.linear(k, fwd, bwd, T, H, math.ceil(vocab))
        mode = self.head_mode
        if mode == COMPILED:
            self.stream(k, fwd, bwd, 4 * a * H * T)  # the residual add and the final norm
            fwd.add(self.gpu(k, 0.0, 2 * a * vocab * T))  # cross-entropy: two passes over the logits
            bwd.add(self.gpu(k, 0.0, 2 * a * vocab * T))  # read the logits, write their gradient
        else:
            self.stream(k, fwd, bwd, 2 * a * H * T)  # the final norm
            fwd.add(self.gpu(k, 0.0, (a + 4) * vocab * T))  # logits.float()
            fwd.add(self.gpu(k, 0.0, 8 * vocab * T))  # log-softmax
            for nbytes in (4 * vocab * T, 12 * vocab * T, (4 + a) * vocab * T):
                bwd.add(self.gpu(k, 0.0, nbytes))
        if mode != FUSED and a < 4:  # the head's weight (the embedding, when tied) cast per microbatch
            self.stream(k, fwd, bwd, CAST_BYTES * H * vocab, GRAD_CAST_BYTES / CAST_BYTES)
        return fwd.seconds(k, mode, True), bwd.seconds(k, mode, False), w
