"""The planner's activation bytes per layer (planner/memory.py) against what the runtime's block really saves for its
backward, counted with autograd's saved-tensor hooks: the model must not say a layout fits when its saved tensors
do not. One process, CPU, float32."""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest
import torch
from helpers_plan import cluster

from hetero_llm.layout import Mlp, Norm, Packing, Position
from hetero_llm.model import forward as fw
from hetero_llm.model.document_mask import DocumentMask
from hetero_llm.model.params import layer_params
from hetero_llm.planner import load_cluster
from hetero_llm.planner.memory import MemoryModel


def saved_bytes_per_token(model, docs: DocumentMask | None, tokens: int) -> float:
    """Bytes of the tensors one block saves for backward, per token, its parameters left out (each storage once)."""
    gen = torch.Generator().manual_seed(0)
    p = {
        i.name.split(".", 2)[2]: (torch.randn(i.shape, generator=gen) * 0.02).requires_grad_()
        for i in layer_params(model, 0)
    }
    x = torch.randn(1, tokens, model.hidden, generator=gen, requires_grad=True)
    params = {t.untyped_storage().data_ptr() for t in p.values()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fw.block(p, x, model, docs=docs)
    return sum(saved.values()) / tokens


def long_tailed_documents(tokens: int, seed: int = 0) -> DocumentMask:
    """One row of documents of lognormal lengths (median 48, sigma 1.2: the hot-switching bench's), 8 or more
    positions each (the ladder pads shorter ones to 8: the model's bound is for documents of 8 or more)."""
    rng = np.random.default_rng(seed)
    spans, positions, start = [], np.zeros((1, tokens), dtype=np.int64), 0
    while start < tokens:
        n = int(min(tokens - start, max(8, rng.lognormal(np.log(48), 1.2))))
        spans.append((0, start, n))
        positions[0, start : start + n] = np.arange(n)
        start += n
    return DocumentMask.from_spans(np.array(spans), positions)


VARIANTS = [
    (norm, position, mlp)
    for norm in (Norm.LAYERNORM, Norm.RMSNORM)
    for position in (Position.LEARNED, Position.ROPE)
    for mlp in (Mlp.GELU, Mlp.SWIGLU)
]


@pytest.mark.parametrize("packed", [False, True], ids=["windows", "packed documents"])
@pytest.mark.parametrize("norm,position,mlp", VARIANTS, ids=["-".join(x.value for x in v) for v in VARIANTS])
@pytest.mark.parametrize("hidden,heads", [(64, 4), (128, 8)])
def test_layer_activations_bound_what_the_block_saves(tmp_path, packed, norm, position, mlp, hidden, heads):
    c = load_cluster(cluster(tmp_path, seq_len=512, packing=packed))
    model = attrs.evolve(c.model, hidden=hidden, heads=heads, norm=norm, position=position, mlp=mlp)
    c = attrs.evolve(c, model=model)
    assert (c.data.packing is Packing.DOCUMENTS) == packed
    measured = saved_bytes_per_token(model, long_tailed_documents(512) if packed else None, 512)
    modelled = MemoryModel(c).layer_activation_bytes(1)
    # an upper bound (the model counts the layer's input, which the caller's graph holds too) and a close one
    assert measured <= modelled <= 1.15 * measured, (measured, modelled)


def unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
    """Megatron-LM's CoreAttention in plain torch: scaled scores Q K^T over the whole window, the causal mask (an
    additive bias, which saves nothing: Megatron's fused softmax masks inside its kernel), softmax, dropout,
    probabilities x V. q, k, v: (B, nh, S, hd)."""
    S, d = q.shape[-2], q.shape[-1]
    bias = torch.full((S, S), float("-inf")).triu(1)  # (S, S), no gradient
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + bias, dim=-1)  # (B, nh, S, S)
    # torch's fused dropout, which nn.Dropout runs on CUDA (a bool mask; on CPU F.dropout multiplies by a float one)
    return torch.native_dropout(probs, p, True)[0] @ v  # (B, nh, S, hd)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("seq,heads,hidden", [(64, 4, 64), (128, 8, 64)])
def test_unfused_attention_bytes_are_what_megatron_attention_saves(tmp_path, tp, seq, heads, hidden):
    """``plan.attention = "unfused"``: the scores' softmax output, dropout mask and dropout output per score, and Q,
    K, V and the output, against what Megatron-LM's attention (written in torch above) saves for its backward,
    counted with the saved-tensor hooks, on one device of a TP group of ``tp`` (its ``heads / tp`` heads)."""
    path = cluster(tmp_path, seq_len=seq, packing=False)
    path.write_text(path.read_text().replace("[plan]\n", '[plan]\nattention = "unfused"\n'))
    c = load_cluster(path)
    c = attrs.evolve(c, model=attrs.evolve(c.model, hidden=hidden, heads=heads, position=Position.LEARNED))
    torch.manual_seed(0)
    nh, hd = heads // tp, hidden // heads
    q, k, v = (torch.randn(1, nh, seq, hd, requires_grad=True) for _ in range(3))
    wo = torch.randn(hidden, nh * hd, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() != wo.untyped_storage().data_ptr():
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = unfused_attention(q, k, v, 0.1)
        y.transpose(1, 2).reshape(1, seq, nh * hd) @ wo.T  # the output projection saves its input
    measured = sum(saved.values()) / seq
    assert MemoryModel(c).attention_activation_bytes(tp) == pytest.approx(measured, rel=1e-9)
    flash = MemoryModel(attrs.evolve(c, limits=attrs.evolve(c.limits, attention="flash")))
    # flash (the runtime's SDPA) keeps no S x S matrix, only a float per head and query (its log-sum-exp)
    assert measured - flash.attention_activation_bytes(tp) == nh * seq * (2 * 4 + 1) - nh * 4
