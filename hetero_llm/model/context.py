"""Ring attention over a context-parallel row: each CP rank holds two chunks of every row (``cp_chunks``).

What each rank holds: its queries, keys and values at the positions ``cp_chunks.local_positions`` gives (chunks
r and 2cp-1-r of 2cp), cut here into two *pieces* (the two chunks). Keys and values go round the CP ring
(``hetero_llm.comm.ring``): at step s a rank holds the pieces of CP rank r-s, so after cp steps every query
has met every key. Each (query piece, key piece) pair is a *block*, computed with plain matmuls in float32
(bf16 inputs are upcast per block) with an explicit mask where needed, and merged into the query piece's
running output with the online-softmax correction through log-sum-exp.

Which blocks are skipped (not computed, not masked away): a block whose every key comes after every query,
and, with packed documents, a block where no row has a document on both sides (the per-piece min/max of
document ids and positions decide, once per microbatch). Under the zigzag a rank computes 2cp+1 of its 4cp
blocks without documents, the same number on every rank. A block whose every key comes before every query
and that has no documents needs no mask.

What overlaps: the next step's keys and values are posted (``Ring.shift``) before the current step's blocks
are computed and waited for only after them; with ``ring.overlap`` false (the layout's ``cp_overlap = false``)
each transfer is posted after the blocks and waited for at once, the same messages in the same order. On an
emulated device ``ring.pace`` makes each step's blocks last their modelled time (their visible query/key pairs)
while the posted transfer travels. The backward ring (as zhuzilin/ring-flash-attention's zigzag
ring) sends keys and values round again, and with them the float32 gradients of the keys and values held:
each rank adds its blocks' share and passes them on, so after cp steps each rank's own key/value gradients
come home. It recomputes each block's probabilities from the forward's log-sum-exp, saving only the local
q, k, v, output and log-sum-exp (nothing proportional to the whole row).

Re-entrant: a recomputed forward (``torch.utils.checkpoint``) runs the same steps in the same order on every
CP rank. The positions and documents of every rank are gathered once per microbatch (``ContextShard``
caches them with the block plan), so a recomputed forward sends only keys and values.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol

import attrs
import torch

KV_TAG, DKV_TAG = 1 << 21, (1 << 21) + 8  # keys/values and their gradients travel the ring at once


class KVRing(Protocol):
    """What attention needs of the CP group (``hetero_llm.comm.ring.Ring``: model math knows no ranks)."""

    @property
    def size(self) -> int: ...

    @property
    def overlap(self) -> bool: ...

    @property
    def pace(self) -> Callable[[float, int, int], None] | None: ...

    def source(self, step: int) -> int: ...

    def shift(self, tensors: list[torch.Tensor], tag: int) -> _Pending: ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


class _Pending(Protocol):
    def wait(self) -> list[torch.Tensor]: ...


@attrs.frozen(eq=False)
class ContextShard:
    """One microbatch's view of a context-parallel row on one CP rank (the same object for every layer)."""

    ring: KVRing
    q_pos: torch.Tensor  # (T_local,) int64: global positions in the row of the local tokens
    doc: torch.Tensor | None  # (B, T_local) int64: document of each local token in its row, -1 at padding
    #                          (None: each row is one causal sequence)
    positions: torch.Tensor  # (B, T_local) int64: what RoPE / learned embeddings use (position in its document)
    _plan: list = attrs.field(factory=list, init=False, repr=False)  # the _Plan, made at the first attention


@attrs.frozen
class _Block:
    q: slice  # query piece
    k: slice  # key piece of the source rank
    masked: bool  # False: every key is visible to every query


@attrs.frozen(eq=False)
class _Plan:
    """Every CP rank's key positions and documents, and the blocks each ring step computes."""

    k_pos: list[torch.Tensor]  # by CP index: (T_local,)
    k_doc: list[torch.Tensor] | None  # by CP index: (B, T_local)
    steps: list[list[_Block]]  # by ring step
    _pairs: dict[int, int] = attrs.field(factory=dict)  # by ring step: visible query/key pairs (emulated pacing)

    def pairs(self, shard: ContextShard, step: int, rows: int) -> int:
        """The (row, query, key) pairs that see each other in ring step ``step``'s blocks over ``rows`` rows
        (made on first use: only an emulated device's pacing asks)."""
        if step not in self._pairs:
            src, total = shard.ring.source(step), 0
            for b in self.steps[step]:
                if b.masked:
                    m = self.mask(shard, src, b)  # (B or 1, 1, 1, Lq, Lk)
                    total += int(m.sum()) * (rows if m.shape[0] == 1 else 1)
                else:
                    total += rows * (b.q.stop - b.q.start) * (b.k.stop - b.k.start)
            self._pairs[step] = total
        return self._pairs[step]

    def mask(self, shard: ContextShard, src: int, b: _Block) -> torch.Tensor:
        """(B or 1, 1, 1, Lq, Lk) bool: which keys each query sees, broadcasting over heads."""
        visible = shard.q_pos[b.q, None] >= self.k_pos[src][None, b.k]  # (Lq, Lk)
        if shard.doc is not None and self.k_doc is not None:
            dq, dk = shard.doc[:, b.q], self.k_doc[src][:, b.k]
            visible = visible & (dq[:, :, None] == dk[:, None, :]) & (dq[:, :, None] >= 0)  # (B, Lq, Lk)
        return visible.view(-1, 1, 1, *visible.shape[-2:])


def _pieces(n: int) -> list[slice]:
    """The two chunks of a rank's ``n`` local positions (zigzag), or the whole row cut in two."""
    return [s for s in (slice(0, n // 2), slice(n // 2, n)) if s.stop > s.start]


def _doc_range(doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row the lowest and highest document id of ``doc`` (B, L), padding left out (empty: lo > hi)."""
    lo = torch.where(doc < 0, torch.iinfo(torch.int64).max, doc).amin(1)
    return lo, doc.amax(1)


def _make_plan(shard: ContextShard) -> _Plan:
    ring = shard.ring
    k_pos = ring.all_gather(shard.q_pos)
    k_doc = ring.all_gather(shard.doc) if shard.doc is not None else None
    q_pos, pos = shard.q_pos.cpu(), [p.cpu() for p in k_pos]  # one sync per microbatch: decisions on the host
    doc = shard.doc.cpu() if shard.doc is not None else None
    docs = [d.cpu() for d in k_doc] if k_doc is not None else None
    pieces = _pieces(len(q_pos))
    steps = []
    for step in range(ring.size):
        src = ring.source(step)
        blocks = []
        for qs in pieces:
            for ks in pieces:
                qp, kp = q_pos[qs], pos[src][ks]
                if kp.min() > qp.max():  # every key after every query
                    continue
                if doc is not None and docs is not None:
                    (qlo, qhi), (klo, khi) = _doc_range(doc[:, qs]), _doc_range(docs[src][:, ks])
                    if not bool(((qlo <= khi) & (klo <= qhi)).any()):  # no row has a document on both sides
                        continue
                blocks.append(_Block(qs, ks, doc is not None or bool(kp.max() > qp.min())))
        steps.append(blocks)
    return _Plan(k_pos, k_doc, steps)


def _plan_of(shard: ContextShard) -> _Plan:
    if not shard._plan:
        shard._plan.append(_make_plan(shard))
    return shard._plan[0]


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """q (B, nh, T_local, hd), k and v (B, nkv, T_local, hd) -> (B, nh, T_local, hd), in q's dtype.

    A query sees a key iff they are in the same row, the same document (when ``shard.doc`` is given; padding
    is in none) and the key's global position is not after the query's. A query that sees nothing gets zeros.
    Grouped-query attention: query head i reads key/value head i // (nh / nkv); keys and values travel
    unexpanded.
    """
    out = _RingAttention.apply(q, k, v, shard)
    assert isinstance(out, torch.Tensor)
    return out


# ------------------------------------------------------------------------------------------
# One block: float32, queries grouped by their key/value head as (B, nkv, g, L, hd).


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (queries that see nothing yet) as 0, so exp(s - lse) is 0 there rather than NaN."""
    return torch.where(torch.isinf(lse), 0.0, lse)


def _block_forward(q, k, v, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax(q k^T) v of one block and its log-sum-exp: q (B, nkv, g, Lq, hd), k and v (B, nkv, Lk, hd)."""
    s = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale  # (B, nkv, g, Lq, Lk)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, nkv, g, Lq)
    return torch.exp(s - _finite(lse)[..., None]) @ v.unsqueeze(2), lse


def _block_backward(q, k, v, mask, scale: float, dout, lse, delta):
    """One block's share of dq, dk, dv, its probabilities recomputed from the whole row's log-sum-exp."""
    s = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - _finite(lse)[..., None])  # (B, nkv, g, Lq, Lk)
    dv = (p.transpose(-1, -2) @ dout).sum(2)  # (B, nkv, Lk, hd): summed over the query heads sharing it
    ds = p * (dout @ v.unsqueeze(2).transpose(-1, -2) - delta[..., None]) * scale
    return ds @ k.unsqueeze(2), (ds.transpose(-1, -2) @ q).sum(2), dv


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax results over disjoint keys, combined (online softmax) in float32."""
    new = torch.logaddexp(lse, l)
    safe = _finite(new)
    return out * torch.exp(lse - safe)[..., None] + o * torch.exp(l - safe)[..., None], new


def _grouped(t: torch.Tensor, nkv: int) -> torch.Tensor:
    """(B, nh, T, hd) -> float32 (B, nkv, g, T, hd): query head i is in group i // g of key/value head i // g."""
    B, nh, T, hd = t.shape
    return t.float().view(B, nkv, nh // nkv, T, hd)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, shard: ContextShard):
        plan, ring = _plan_of(shard), shard.ring
        B, nh, T, hd = q.shape
        scale = 1.0 / math.sqrt(hd)
        qg = _grouped(q, k.shape[1])
        out = torch.zeros_like(qg)  # (B, nkv, g, T, hd) float32
        lse = torch.full(qg.shape[:-1], float("-inf"), device=q.device)  # (B, nkv, g, T)
        kv = torch.stack([k, v])  # (2, B, nkv, T, hd): what travels, in the compute dtype
        for step in range(ring.size):
            more = step + 1 < ring.size
            nxt = ring.shift([kv], KV_TAG) if more and ring.overlap else None  # travels while this step computes
            t0, src = time.perf_counter(), ring.source(step)
            for b in plan.steps[step]:
                mask = plan.mask(shard, src, b) if b.masked else None
                o, l = _block_forward(qg[:, :, :, b.q], kv[0][:, :, b.k].float(), kv[1][:, :, b.k].float(), mask, scale)
                out[:, :, :, b.q], lse[..., b.q] = _merge(out[:, :, :, b.q], lse[..., b.q], o, l)
            if ring.pace is not None:
                ring.pace(t0, plan.pairs(shard, step, B), 1)
            if more and not ring.overlap:
                nxt = ring.shift([kv], KV_TAG)
            if nxt is not None:
                kv = nxt.wait()[0]
        y = out.view(B, nh, T, hd).to(q.dtype)
        ctx.save_for_backward(q, k, v, y, lse)
        ctx.shard = shard
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse = ctx.saved_tensors
        shard: ContextShard = ctx.shard
        plan, ring = _plan_of(shard), shard.ring
        nkv, scale = k.shape[1], 1.0 / math.sqrt(q.shape[-1])
        qg, dout = _grouped(q, nkv), _grouped(dy, nkv)
        delta = (dout * _grouped(y, nkv)).sum(-1)  # (B, nkv, g, T): rowsum(dP * P) of the softmax backward
        dq = torch.zeros_like(qg)
        kv = torch.stack([k, v])
        pending = None  # the gradients of the keys/values held now, summed by the ranks before this one
        for step in range(ring.size):
            more = step + 1 < ring.size
            nxt = ring.shift([kv], KV_TAG) if more and ring.overlap else None
            t0, src = time.perf_counter(), ring.source(step)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # (2, B, nkv, T, hd)
            for b in plan.steps[step]:
                mask = plan.mask(shard, src, b) if b.masked else None
                kb, vb = kv[0][:, :, b.k].float(), kv[1][:, :, b.k].float()
                ql, dl = qg[:, :, :, b.q], dout[:, :, :, b.q]
                dqb, dkb, dvb = _block_backward(ql, kb, vb, mask, scale, dl, lse[..., b.q], delta[..., b.q])
                dq[:, :, :, b.q] += dqb
                dkv[0][:, :, b.k] += dkb
                dkv[1][:, :, b.k] += dvb
            if ring.pace is not None:
                ring.pace(t0, plan.pairs(shard, step, q.shape[0]), 2)
            if pending is not None:
                dkv += pending.wait()[0]
            pending = ring.shift([dkv], DKV_TAG)  # on to the next rank, which holds these keys next step
            if more and not ring.overlap:  # both transfers at once, then waited for before the next blocks
                nxt = ring.shift([kv], KV_TAG)
                pending.wait()
            if nxt is not None:
                kv = nxt.wait()[0]
        assert pending is not None
        mine = pending.wait()[0]  # this rank's own keys' gradients, home after a full circle
        return dq.view(q.shape).to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None
