"""Attention over a context-parallel row: each CP rank holds part of the row's positions (``cp_chunks``).

A first, simple version: every rank all-gathers the row's keys and values and attends with an explicit mask.
Exact, O(T) memory per rank for keys and values; the ring version replaces it with the same signature.
"""

from __future__ import annotations

import math
from typing import Protocol

import attrs
import torch
import torch.distributed.nn.functional as dist_fn


class KVRing(Protocol):
    """What attention needs of the CP group (``hetero_llm.comm.ring.Ring``; model math knows no ranks)."""

    group: object
    index: int

    @property
    def size(self) -> int: ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


@attrs.frozen(eq=False)
class ContextShard:
    """One microbatch's view of a context-parallel row on one CP rank."""

    ring: KVRing
    q_pos: torch.Tensor  # (T_local,) int64: global positions in the row of the local tokens
    doc: torch.Tensor | None  # (B, T_local) int64: document of each local token in its row, -1 at padding
    #                          (None: each row is one causal sequence)
    positions: torch.Tensor  # (B, T_local) int64: what RoPE / learned embeddings use (position in its document)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """q (B, nh, T_local, hd), k and v (B, nkv, T_local, hd) -> (B, nh, T_local, hd).

    A query sees a key iff they are in the same row, the same document (when ``shard.doc`` is given; padding
    is in none) and the key's global position is not after the query's. A query that sees nothing gets zeros.
    """
    ring = shard.ring
    if ring.size > 1:
        k_all = torch.cat(dist_fn.all_gather(k.contiguous(), group=ring.group), dim=2)
        v_all = torch.cat(dist_fn.all_gather(v.contiguous(), group=ring.group), dim=2)
    else:
        k_all, v_all = k, v
    k_pos = torch.cat(ring.all_gather(shard.q_pos))
    visible = shard.q_pos[:, None] >= k_pos[None, :]  # (T_local, T)
    if shard.doc is not None:
        k_doc = torch.cat(ring.all_gather(shard.doc), dim=1)  # (B, T)
        same = (shard.doc[:, :, None] == k_doc[:, None, :]) & (shard.doc[:, :, None] >= 0)
        visible = (visible & same).unsqueeze(1)  # (B, 1, T_local, T)
    nh, nkv = q.shape[1], k.shape[1]
    if nkv != nh:
        k_all, v_all = k_all.repeat_interleave(nh // nkv, dim=1), v_all.repeat_interleave(nh // nkv, dim=1)
    scores = (q.float() @ k_all.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse))  # rows that see nothing: zeros
    return (probs @ v_all.float()).to(q.dtype)
