"""The model as pure functions over a dict of parameters keyed by global names.

Nothing here knows about ranks. Tensor parallelism enters through a ``TP`` pair of functions that
the caller supplies (Megatron's f and g operators): ``enter`` is identity forward / all-reduce
backward, ``exit`` is all-reduce forward / identity backward. With ``NO_TP`` the same code is the
one-process model. A sharded weight simply has fewer rows (column-parallel) or columns
(row-parallel); head counts are read off the shard shapes.

A linear layer is ``x @ w.T`` by default; a stage whose schedule splits its backward passes the
``linear`` of a ``WeightGradStore`` (``hetero_llm.runtime.wgrad``) instead, the same math with the weight
gradient put off.

Precision is how a stage computes, not what: parameters are always float32 leaves (the optimizer's
master weights) and every layer computes in the dtype of the activations it receives, casting its
weights on use. Gradients flow back through the casts, so they accumulate in float32 ``.grad``.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from hetero_llm.layout import Mlp, ModelSpec, Norm, Position
from hetero_llm.model.context import ContextShard, context_attention
from hetero_llm.model.document_mask import DocumentMask
from hetero_llm.model.params import BIAS_OF, ParamInfo, layer_params

Params = dict[str, torch.Tensor]
BlockFn = Callable[..., torch.Tensor]  # (one block's params by local name, x, docs=None, ctx=None) -> x
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, w) -> x @ w.T in x's dtype


@attrs.frozen
class TP:
    enter: Callable[[torch.Tensor], torch.Tensor]
    exit: Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


NO_TP = TP(_identity, _identity)


@attrs.frozen
class StageShape:
    """Which part of the model a stage computes."""

    layer_lo: int
    layer_hi: int
    first: bool
    last: bool


@attrs.frozen
class Compute:
    """How a stage computes: the same math whatever is chosen, so the same model (up to rounding).

    ``dtype``: compute dtype (float32, or bfloat16 from float32 weights). ``recompute``: keep only
    each block's input and recompute the block in backward. ``compile``: ``torch.compile`` the
    block apply (one graph for every block of the stage: blocks see their parameters by local name).
    """

    dtype: torch.dtype = torch.float32
    recompute: bool = False
    compile: bool = False


FP32 = Compute()

# ------------------------------------------------------------------------------------------
# Initialization: a pure function of (seed, global name), so every layout starts identical.


def param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_full(info: ParamInfo, model: ModelSpec, seed: int) -> torch.Tensor:
    """The full float32 tensor a one-process run creates for ``info`` (always on CPU)."""
    leaf = info.name.rsplit(".", 1)[-1]
    if info.name.endswith("norm.weight"):
        return torch.ones(info.shape)
    if info.name.endswith("norm.bias") or leaf in BIAS_OF.values():
        return torch.zeros(info.shape)
    gen = torch.Generator().manual_seed(param_seed(seed, info.name))
    std = model.init_std
    if leaf in ("wo", "w2"):  # residual projections, scaled as in GPT-2
        std = std / math.sqrt(2 * model.layers)
    return torch.randn(info.shape, generator=gen) * std


def init_shard(info: ParamInfo, model: ModelSpec, seed: int, lo: int, hi: int) -> torch.Tensor:
    full = init_full(info, model, seed)
    if info.shard_dim is None:
        return full
    return full.narrow(info.shard_dim, lo, hi - lo).contiguous()


# ------------------------------------------------------------------------------------------
# Layers


def _norm(x: torch.Tensor, p: Params, prefix: str, model: ModelSpec) -> torch.Tensor:
    weight = p[f"{prefix}.weight"].to(x.dtype)  # the cast is a no-op (no copy, no graph node) in float32
    if model.norm is Norm.LAYERNORM:
        return F.layer_norm(x, (x.shape[-1],), weight, p[f"{prefix}.bias"].to(x.dtype), eps=model.norm_eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps=model.norm_eps)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.to(x.dtype).T


PLAIN_LINEAR: Linear = _linear  # what a stage uses unless its backwards split (WeightGradStore.linear)


def _linears(x: torch.Tensor, weights: list[torch.Tensor], linear: Linear = _linear) -> list[torch.Tensor]:
    """``x @ w.T`` for each weight (one input). When the weights are cast anyway, the cast copy is
    also the concatenation, so the projections run as one GEMM (as a fused QKV layer would); in
    float32 they stay separate GEMMs and nothing is copied."""
    if linear is not _linear:
        return [linear(x, w) for w in weights]
    if weights[0].dtype == x.dtype:
        return [x @ w.T for w in weights]
    fused = torch.cat([w.to(x.dtype) for w in weights])
    return list((x @ fused.T).split([w.shape[0] for w in weights], dim=-1))


def rope_tables(
    seq_len: int, head_dim: int, device: torch.device, dtype: torch.dtype, theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)  # (T, hd/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_at(
    positions: torch.Tensor, head_dim: int, dtype: torch.dtype, theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_tables``' rows at ``positions`` (B, T), as (B, 1, T, hd/2): the same products, so the same values."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = (positions.to(torch.float32)[..., None] * inv).unsqueeze(1)  # (B, 1, T, hd/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, T, hd); rotate pairs (even, odd)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


def block_params(p: Params, i: int, model: ModelSpec) -> Params:
    """Block ``i``'s parameters keyed by local names (``attn.wq``), so one compiled block serves all."""
    return {name: p[f"layers.{i}.{name}"] for name in _local_names(model)}


@functools.cache
def _local_names(model: ModelSpec) -> tuple[str, ...]:
    return tuple(info.name.split(".", 2)[2] for info in layer_params(model, 0))  # drop "layers.0."


def block(
    p: Params,
    x: torch.Tensor,
    model: ModelSpec,
    tp: TP = NO_TP,
    linear: Linear = _linear,
    docs: DocumentMask | None = None,
    ctx: ContextShard | None = None,
) -> torch.Tensor:
    """One transformer block over its parameters ``p`` (local names, see ``block_params``).

    ``x`` (B, T, C) is replicated across the TP group; the block computes in ``x``'s dtype. ``docs``: the
    rows are packed documents; attention stays inside each, positions restart in each. ``ctx``: the rows are
    split across a context-parallel group (``x`` holds this rank's positions of them); it carries the
    positions and documents itself, so ``docs`` is None then.
    """
    if ctx is not None and docs is not None:
        raise ValueError("a context-parallel block takes its documents from ctx, not docs")
    B, T, _ = x.shape
    hd = model.head_dim

    h = tp.enter(_norm(x, p, "attn_norm", model))
    q, k, v = _projections(h, p, ["attn.wq", "attn.wk", "attn.wv"], linear)  # (B, T, C/tp), (B, T, KV/tp) x2
    nh, nkv = q.shape[-1] // hd, k.shape[-1] // hd  # local query and key/value heads
    q = q.view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
    k, v = (t.view(B, T, nkv, hd).transpose(1, 2) for t in (k, v))  # (B, nkv, T, hd)
    if model.position is Position.ROPE:
        if ctx is not None:
            cos, sin = rope_at(ctx.positions, hd, q.dtype, model.rope_theta)
        else:
            cos, sin = rope_tables(T, hd, x.device, q.dtype, model.rope_theta)
            if docs is not None:
                cos, sin = docs.at_positions(cos), docs.at_positions(sin)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    y = _attention(q, k, v, docs, ctx)  # (B, nh, T, hd)
    y = y.transpose(1, 2).reshape(B, T, nh * hd)
    x = x + _bias(tp.exit(linear(y, p["attn.wo"])), p, "attn.wo")  # row-parallel: partial sums reduced by exit

    h = tp.enter(_norm(x, p, "mlp_norm", model))
    if model.mlp is Mlp.SWIGLU:
        a, gate = _projections(h, p, ["mlp.w1", "mlp.w3"], linear)  # (B, T, F/tp) each
        a = F.silu(a) * gate
    else:
        a = F.gelu(_projections(h, p, ["mlp.w1"], linear)[0], approximate="tanh")  # (B, T, F/tp)
    return x + _bias(tp.exit(linear(a, p["mlp.w2"])), p, "mlp.w2")


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: DocumentMask | None, ctx: ContextShard | None
) -> torch.Tensor:
    """Causal attention of q (B, nh, T, hd) over k, v (B, nkv, T, hd): inside documents, across CP ranks."""
    if ctx is not None:  # keys and values travel the ring unexpanded: GQA's sharing is done inside
        # never compiled: the layout rules refuse train.compile = 'blocks' with cp > 1 (the ring's p2p and host-side
        # block decisions do not trace)
        return context_attention(q, k, v, ctx)
    nh, nkv = q.shape[1], k.shape[1]
    if nkv != nh:  # grouped-query attention: query head i reads key/value head i // (nh / nkv)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    if docs is not None:
        return docs.attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _bias(y: torch.Tensor, p: Params, weight: str) -> torch.Tensor:
    """``y`` plus the bias of projection ``weight`` when the model has biases (model.bias)."""
    prefix, leaf = weight.rsplit(".", 1)
    b = p.get(f"{prefix}.{BIAS_OF[leaf]}")
    return y if b is None else y + b.to(y.dtype)


def _projections(h: torch.Tensor, p: Params, weights: list[str], linear: Linear) -> list[torch.Tensor]:
    """The column-parallel projections ``weights`` of ``h`` (one GEMM where ``_linears`` fuses), with their biases."""
    return [_bias(y, p, w) for y, w in zip(_linears(h, [p[w] for w in weights], linear), weights)]


def make_block_fn(model: ModelSpec, tp: TP = NO_TP, compute: Compute = FP32, linear: Linear = _linear) -> BlockFn:
    """A stage's block apply, built once per stage: eager or compiled, recomputed in backward or not."""
    if compute.compile and tp is not NO_TP:
        # c10d collectives do not trace: the TP all-reduces run eagerly between compiled pieces.
        tp = TP(torch.compiler.disable(tp.enter), torch.compiler.disable(tp.exit))

    def apply(p: Params, x: torch.Tensor, docs: DocumentMask | None = None, ctx: ContextShard | None = None):
        return block(p, x, model, tp, linear, docs, ctx)

    fn = torch.compile(apply) if compute.compile else apply
    if not compute.recompute:
        return fn

    def recomputed(p: Params, x: torch.Tensor, docs: DocumentMask | None = None, ctx: ContextShard | None = None):
        # The weight casts happen inside, so the bf16 copies are recomputed too rather than kept. With ctx the
        # recomputed forward runs the ring again: every CP rank recomputes the same block at the same point.
        return torch.utils.checkpoint.checkpoint(fn, p, x, docs, ctx, use_reentrant=False)

    return recomputed


def embed(
    p: Params, tokens: torch.Tensor, model: ModelSpec, docs: DocumentMask | None = None, ctx: ContextShard | None = None
) -> torch.Tensor:
    x = F.embedding(tokens, p["embed.tok"])  # (B, T, C), float32: the cast to the compute dtype follows
    if model.position is Position.LEARNED:
        where = ctx or docs  # this rank's positions of a CP row, or positions restarting in every document
        x = x + (p["embed.pos"][where.positions] if where is not None else p["embed.pos"][: tokens.shape[1]])
    return x


def head(p: Params, x: torch.Tensor, model: ModelSpec, linear: Linear = _linear) -> torch.Tensor:
    weight = p["embed.tok"] if model.tie_embeddings else p["lm_head.weight"]
    return linear(_norm(x, p, "final_norm", model), weight)  # (B, T, V)


def stage_forward(
    p: Params,
    inp: torch.Tensor,
    shape: StageShape,
    model: ModelSpec,
    tp: TP = NO_TP,
    compute: Compute = FP32,
    block_fn: BlockFn | None = None,
    linear: Linear = _linear,
    docs: DocumentMask | None = None,
    ctx: ContextShard | None = None,
) -> torch.Tensor:
    """Tokens (first stage) or activations in; activations or logits (last stage) out.

    Activations come out in ``compute.dtype`` (received ones arrive in it); ``block_fn`` is the
    stage's ``make_block_fn`` (built with the same ``linear``), built here when not given. ``docs``: the
    microbatch's document mask when its rows are packed documents. ``ctx``: this CP rank's part of the
    microbatch's rows (``inp`` holds its positions only; see ``block``).
    """
    x = embed(p, inp, model, docs, ctx).to(compute.dtype) if shape.first else inp
    run = block_fn or make_block_fn(model, tp, compute, linear)
    for i in range(shape.layer_lo, shape.layer_hi):
        x = run(block_params(p, i, model), x, docs, ctx)
    return head(p, x, model, linear) if shape.last else x


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) cross-entropy: the caller divides by the GLOBAL token count."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
