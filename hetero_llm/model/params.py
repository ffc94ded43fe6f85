"""Global parameter names, full shapes and tensor-parallel shard dims: what a stage holds (``stage_params``),
what every memory estimate starts from (launch/memory.py, planner/memory.py). Torch-free.

Names are global (``layers.7.attn.wq``), never stage-local, so a checkpoint or a gradient means the
same thing under every layout. A TP shard is always a contiguous slice of the full tensor along one
dim (or the full tensor, for replicated parameters): that is what lets gradient sync and hot
switching cut shards of different layouts into common blocks.

Q, K and V are separate matrices rather than one fused ``wqkv`` so that a head-split is a single
contiguous row range of each (a fused QKV shard would be three disjoint ranges).
"""

from __future__ import annotations

import attrs

from hetero_llm.layout import Mlp, ModelSpec, Norm, Position


@attrs.frozen
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    shard_dim: int | None  # dim split across a stage's TP ranks; None = replicated in the TP group
    decay: bool  # AdamW weight decay applies (weight matrices, not norms or embeddings)
    layer: int | None  # block index, or None for embedding / final norm / head


def _norm(prefix: str, model: ModelSpec, layer: int | None) -> list[ParamInfo]:
    out = [ParamInfo(f"{prefix}.weight", (model.hidden,), None, False, layer)]
    if model.norm is Norm.LAYERNORM:
        out.append(ParamInfo(f"{prefix}.bias", (model.hidden,), None, False, layer))
    return out


# model.bias: the bias of each projection, named after its weight. Column-parallel biases are split with
# their weight's rows; row-parallel ones (bo, b2) are replicated and added once, after the all-reduce.
BIAS_OF = {"wq": "bq", "wk": "bk", "wv": "bv", "wo": "bo", "w1": "b1", "w3": "b3", "w2": "b2"}


def _proj(name: str, shape: tuple[int, int], shard_dim: int, model: ModelSpec, i: int) -> list[ParamInfo]:
    """A projection weight (column-parallel: shard_dim 0, row-parallel: 1) and, with model.bias, its bias."""
    out = [ParamInfo(name, shape, shard_dim, True, i)]
    if model.bias:
        prefix, leaf = name.rsplit(".", 1)
        out.append(ParamInfo(f"{prefix}.{BIAS_OF[leaf]}", shape[:1], 0 if shard_dim == 0 else None, False, i))
    return out


def layer_params(model: ModelSpec, i: int) -> list[ParamInfo]:
    C, F = model.hidden, model.ffn_width
    KV = model.kv_heads_n * model.head_dim  # grouped-query attention: fewer key/value rows
    p = f"layers.{i}"
    out = _norm(f"{p}.attn_norm", model, i)
    for w, rows in (("wq", C), ("wk", KV), ("wv", KV)):
        out += _proj(f"{p}.attn.{w}", (rows, C), 0, model, i)  # column-parallel
    out += _proj(f"{p}.attn.wo", (C, C), 1, model, i)  # row-parallel
    out += _norm(f"{p}.mlp_norm", model, i)
    out += _proj(f"{p}.mlp.w1", (F, C), 0, model, i)
    if model.mlp is Mlp.SWIGLU:
        out += _proj(f"{p}.mlp.w3", (F, C), 0, model, i)
    out += _proj(f"{p}.mlp.w2", (C, F), 1, model, i)
    return out


def embedding_params(model: ModelSpec) -> list[ParamInfo]:
    out = [ParamInfo("embed.tok", (model.vocab, model.hidden), None, False, None)]
    if model.position is Position.LEARNED:
        out.append(ParamInfo("embed.pos", (model.seq_len, model.hidden), None, False, None))
    return out


def head_params(model: ModelSpec) -> list[ParamInfo]:
    """The final norm and the output head. With model.tie_embeddings the head is ``embed.tok`` itself: a
    last stage holds a copy of it, and gradient sync sums the copies' gradients (Megatron's embedding group)."""
    if model.tie_embeddings:
        return _norm("final_norm", model, None) + embedding_params(model)[:1]
    return _norm("final_norm", model, None) + [
        ParamInfo("lm_head.weight", (model.vocab, model.hidden), None, True, None)
    ]


def stage_params(model: ModelSpec, layer_lo: int, layer_hi: int, first: bool, last: bool) -> list[ParamInfo]:
    """Parameters a stage holding layers [layer_lo, layer_hi) owns, in a fixed order (each once)."""
    out = embedding_params(model) if first else []
    for i in range(layer_lo, layer_hi):
        out += layer_params(model, i)
    if last:
        out += [info for info in head_params(model) if info not in out]  # a tied head on the first stage
    return out


def all_params(model: ModelSpec) -> list[ParamInfo]:
    return stage_params(model, 0, model.layers, True, True)


def shard_range(info: ParamInfo, tp_size: int, tp_index: int) -> tuple[int, int]:
    """The [lo, hi) range along ``info.shard_dim`` that TP rank ``tp_index`` of ``tp_size`` holds."""
    if info.shard_dim is None:
        return 0, info.shape[0]
    n = info.shape[info.shard_dim]
    return tp_index * n // tp_size, (tp_index + 1) * n // tp_size


def count_params(model: ModelSpec) -> int:
    total = 0
    for info in all_params(model):
        n = 1
        for s in info.shape:
            n *= s
        total += n
    return total
