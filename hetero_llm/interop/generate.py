"""``hetero-generate CHECKPOINT_DIR --prompt TEXT``: sample from a trained checkpoint on one device.

The checkpoint (any layout's) is assembled into full parameters and run as one process with a KV cache:
the prompt goes through the model once, then each new token attends to the cached keys and values of
every position before it, so a token costs one position's compute rather than the whole sequence's. The
math is ``model.forward.block``'s (same norms, projections, RoPE pairs, grouped-query heads); greedy decoding
(``--temperature 0``) gives what ``transformers.generate`` gives on the exported model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hetero_llm.layout import Mlp, ModelSpec, Position
from hetero_llm.model.forward import Params, _apply_rope, _bias, _norm, _projections, block_params, head, rope_tables


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.T


class KVCache:
    """Keys and values of every layer for the positions seen so far: (B, kv heads, positions, head size)."""

    def __init__(self, layers: int):
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers
        self.length = 0

    def extend(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        held_k, held_v = self.k[i], self.v[i]
        if held_k is not None and held_v is not None:  # set together
            k, v = torch.cat([held_k, k], dim=2), torch.cat([held_v, v], dim=2)
        self.k[i], self.v[i] = k, v
        return k, v


def _cached_block(p: Params, x: torch.Tensor, model: ModelSpec, cache: KVCache, i: int) -> torch.Tensor:
    """``model.block`` for new positions ``x`` (B, t, C) after ``cache.length`` cached ones."""
    B, t, _ = x.shape
    hd, start = model.head_dim, cache.length
    q, k, v = _projections(_norm(x, p, "attn_norm", model), p, ["attn.wq", "attn.wk", "attn.wv"], _linear)
    nh, nkv = q.shape[-1] // hd, k.shape[-1] // hd
    q = q.view(B, t, nh, hd).transpose(1, 2)  # (B, nh, t, hd)
    k, v = (a.view(B, t, nkv, hd).transpose(1, 2) for a in (k, v))  # (B, nkv, t, hd)
    if model.position is Position.ROPE:
        cos, sin = rope_tables(start + t, hd, x.device, q.dtype, model.rope_theta)
        q, k = _apply_rope(q, cos[start:], sin[start:]), _apply_rope(k, cos[start:], sin[start:])
    k, v = cache.extend(i, k, v)  # (B, nkv, start + t, hd)
    if nkv != nh:
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    # new position j (absolute start + j) sees every cached position and the new ones up to itself
    mask = torch.ones(t, start + t, dtype=torch.bool, device=x.device).tril(diagonal=start)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, t, nh * hd)
    x = x + _bias(y @ p["attn.wo"].T, p, "attn.wo")
    h = _norm(x, p, "mlp_norm", model)
    if model.mlp is Mlp.SWIGLU:
        a, gate = _projections(h, p, ["mlp.w1", "mlp.w3"], _linear)
        a = F.silu(a) * gate
    else:
        a = F.gelu(_projections(h, p, ["mlp.w1"], _linear)[0], approximate="tanh")
    return x + _bias(a @ p["mlp.w2"].T, p, "mlp.w2")


@torch.no_grad()
def forward(params: Params, model: ModelSpec, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (B, t, V) of new tokens ``ids`` (B, t) after the cached positions; the cache takes them in."""
    start = cache.length
    x = F.embedding(ids, params["embed.tok"])
    if model.position is Position.LEARNED:
        x = x + params["embed.pos"][start : start + ids.shape[1]]
    for i in range(model.layers):
        x = _cached_block(block_params(params, i, model), x, model, cache, i)
    cache.length += ids.shape[1]
    return head(params, x, model)


@torch.no_grad()
def generate(
    params: Params,
    model: ModelSpec,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    eos_id: int | None = None,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """New tokens after ``prompt``: greedy when ``temperature`` is 0, else sampled from softmax(logits / T)
    over the ``top_k`` likeliest (0: all); stops after ``eos_id``. ``on_token(1)`` after each new token."""
    gen = torch.Generator().manual_seed(seed)
    device = params["embed.tok"].device
    cache = KVCache(model.layers)
    logits = forward(params, model, torch.tensor([prompt], device=device), cache)[0, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        scaled = logits.float() / temperature if temperature else logits
        if temperature == 0 or not torch.isfinite(scaled).all():  # greedy (or a temperature so small that the
            token = int(logits.argmax())  # logits overflow: its limit, greedy too)
        else:
            if top_k:
                kth = scaled.topk(min(top_k, scaled.numel())).values[-1]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            token = int(torch.multinomial(scaled.softmax(-1).cpu(), 1, generator=gen))
        out.append(token)
        if on_token is not None:
            on_token(1)
        if token == eos_id or len(out) == max_new_tokens:
            break
        logits = forward(params, model, torch.tensor([[token]], device=device), cache)[0, -1]
    return out
