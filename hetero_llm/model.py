"""The model as pure functions over a dict of parameters keyed by global names.

Nothing here knows about ranks. Tensor parallelism enters through a ``TP`` pair of functions that
the caller supplies (Megatron's f and g operators): ``enter`` is identity forward / all-reduce
backward, ``exit`` is all-reduce forward / identity backward. With ``NO_TP`` the same code is the
one-process model. A sharded weight simply has fewer rows (column-parallel) or columns
(row-parallel); head counts are read off the shard shapes.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable

import attrs
import torch
import torch.nn.functional as F

from hetero_llm.layout import ModelSpec, Mlp, Norm, Position
from hetero_llm.params import ParamInfo

Params = dict[str, torch.Tensor]


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
    if info.name.endswith("norm.bias"):
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
    if model.norm is Norm.LAYERNORM:
        return F.layer_norm(x, (x.shape[-1],), p[f"{prefix}.weight"], p[f"{prefix}.bias"], eps=1e-5)
    return F.rms_norm(x, (x.shape[-1],), p[f"{prefix}.weight"], eps=1e-5)


def rope_tables(seq_len: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)  # (T, hd/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, T, hd); rotate pairs (even, odd)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


def block(p: Params, i: int, x: torch.Tensor, model: ModelSpec, tp: TP = NO_TP) -> torch.Tensor:
    """One transformer block; ``x`` (B, T, C) is replicated across the TP group."""
    pre = f"layers.{i}"
    B, T, _ = x.shape
    hd = model.head_dim

    h = tp.enter(_norm(x, p, f"{pre}.attn_norm", model))
    q = h @ p[f"{pre}.attn.wq"].T  # (B, T, C/tp)
    k = h @ p[f"{pre}.attn.wk"].T
    v = h @ p[f"{pre}.attn.wv"].T
    nh = q.shape[-1] // hd  # local heads
    q, k, v = (t.view(B, T, nh, hd).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hd)
    if model.position is Position.ROPE:
        cos, sin = rope_tables(T, hd, x.device, q.dtype)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).reshape(B, T, nh * hd)
    x = x + tp.exit(y @ p[f"{pre}.attn.wo"].T)  # row-parallel: partial sums reduced by exit

    h = tp.enter(_norm(x, p, f"{pre}.mlp_norm", model))
    a = h @ p[f"{pre}.mlp.w1"].T  # (B, T, F/tp)
    if model.mlp is Mlp.SWIGLU:
        a = F.silu(a) * (h @ p[f"{pre}.mlp.w3"].T)
    else:
        a = F.gelu(a, approximate="tanh")
    return x + tp.exit(a @ p[f"{pre}.mlp.w2"].T)


def embed(p: Params, tokens: torch.Tensor, model: ModelSpec) -> torch.Tensor:
    x = F.embedding(tokens, p["embed.tok"])  # (B, T, C)
    if model.position is Position.LEARNED:
        x = x + p["embed.pos"][: tokens.shape[1]]
    return x


def head(p: Params, x: torch.Tensor, model: ModelSpec) -> torch.Tensor:
    return _norm(x, p, "final_norm", model) @ p["lm_head.weight"].T  # (B, T, V)


def stage_forward(p: Params, inp: torch.Tensor, shape: StageShape, model: ModelSpec, tp: TP = NO_TP) -> torch.Tensor:
    """Tokens (first stage) or activations in; activations or logits (last stage) out."""
    x = embed(p, inp, model) if shape.first else inp
    for i in range(shape.layer_lo, shape.layer_hi):
        x = block(p, i, x, model, tp)
    return head(p, x, model) if shape.last else x


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) cross-entropy: the caller divides by the GLOBAL token count."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
