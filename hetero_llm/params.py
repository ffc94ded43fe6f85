"""Global parameter names, full shapes and tensor-parallel shard dims. Torch-free.

Names are global (``layers.7.attn.wq``), never stage-local, so a checkpoint or a gradient means the
same thing under every layout. A TP shard is always a contiguous slice of the full tensor along one
dim (or the full tensor, for replicated parameters): that is what lets gradient sync and hot
switching cut shards of different layouts into common blocks.

Q, K and V are separate matrices rather than one fused ``wqkv`` so that a head-split is a single
contiguous row range of each (a fused QKV shard would be three disjoint ranges).
"""

from __future__ import annotations

import attrs

from hetero_llm.layout import ModelSpec, Mlp, Norm, Position


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


def layer_params(model: ModelSpec, i: int) -> list[ParamInfo]:
    C, F = model.hidden, model.ffn_width
    p = f"layers.{i}"
    out = _norm(f"{p}.attn_norm", model, i)
    out += [ParamInfo(f"{p}.attn.{w}", (C, C), 0, True, i) for w in ("wq", "wk", "wv")]  # column-parallel
    out.append(ParamInfo(f"{p}.attn.wo", (C, C), 1, True, i))  # row-parallel
    out += _norm(f"{p}.mlp_norm", model, i)
    out.append(ParamInfo(f"{p}.mlp.w1", (F, C), 0, True, i))
    if model.mlp is Mlp.SWIGLU:
        out.append(ParamInfo(f"{p}.mlp.w3", (F, C), 0, True, i))
    out.append(ParamInfo(f"{p}.mlp.w2", (C, F), 1, True, i))
    return out


def embedding_params(model: ModelSpec) -> list[ParamInfo]:
    out = [ParamInfo("embed.tok", (model.vocab, model.hidden), None, False, None)]
    if model.position is Position.LEARNED:
        out.append(ParamInfo("embed.pos", (model.seq_len, model.hidden), None, False, None))
    return out


def head_params(model: ModelSpec) -> list[ParamInfo]:
    return _norm("final_norm", model, None) + [ParamInfo("lm_head.weight", (model.vocab, model.hidden), None, True, None)]


def stage_params(model: ModelSpec, layer_lo: int, layer_hi: int, first: bool, last: bool) -> list[ParamInfo]:
    """Parameters a stage holding layers [layer_lo, layer_hi) owns, in a fixed order."""
    out = embedding_params(model) if first else []
    for i in range(layer_lo, layer_hi):
        out += layer_params(model, i)
    return out + (head_params(model) if last else [])


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
