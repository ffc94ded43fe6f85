"""Context parallelism in the planner: what a stage's CP ranks add to its time, and the search's CP start points.
Torch-free.

A stage of ``cp`` > 1 (the layout's ``[[pipelines.stages]] cp``; ``candidates.TPGroup.cp``) holds ``1 / cp`` of
every sequence's tokens on each of its CP ranks, a TP group each (zigzag chunks r and 2 cp - 1 - r: model/cp_chunks.py),
so its matmuls, element-wise work, TP all-reduces, activations and logits are ``1 / cp`` of a TP group's
(roofline.py, cost.py, memory.py). The attention of a rank's queries meets every key once, passing keys and
values round a ring (Megatron-LM's and torchtitan's ring attention), which adds:

- per layer, ``cp - 1`` ring steps forward, each rank sending its K/V chunk (``ring_bytes``) to its neighbour over
  the link between them; backward the K/V chunks again and ``cp`` sends of their float32 gradients. Each transfer
  overlaps one of the ``cp`` blocks the rank's attention runs in and costs what the block does not hide; the
  last gradients come home after the last block, exposed; with the layout's ``cp_overlap = false`` every
  transfer is exposed (``ring_exposed``, the runtime's order of model/context.py);
- the slowest CP rank's attention: the ring couples the ranks every layer, and packed documents fall unevenly on
  the zigzag chunks, so the attention is charged at ``Documents.cp_imbalance`` x a balanced rank's (cost.py);
- the all-reduce of the stage's gradients over its CP ranks, which hold the same weights (``cp_sync_time``),
  over the intra-node link, before the sync between pipelines.

The search's CP moves and start points are in move_parts.py (``reshaped``, ``with_cp``) and moves.py.
"""

from __future__ import annotations

from typing import Any

from hetero_llm.planner.candidates import Candidate, TPGroup
from hetero_llm.planner.catalogue import ROOFLINE

FLOAT32_BYTES = 4  # the ring's key/value gradients travel in float32 (model/context.py)

# ``cost``: a cost.PlannerCostModel (not imported, not even for type checking: cost.py imports this module)
Cost = Any


def ring_bytes(cost: Cost, group: TPGroup, rows: int) -> float:
    """Bytes one CP rank sends its ring neighbour per step of one layer's forward: its K and V chunk,
    ``2 x rows S / cp x kv_heads / tp x head_dim x`` the activation bytes."""
    m = cost.model
    return 2 * rows * cost.S / group.cp * m.kv_heads_n / group.tp * m.head_dim * cost.act_bytes


def ring_exposed(cost: Cost, group: TPGroup, rows: int) -> tuple[float, float]:
    """(forward, backward) seconds per layer of the ring that the attention does not hide: a rank's attention
    runs in ``cp`` blocks (its queries against each K/V chunk in turn); a transfer crosses the link between ring
    neighbours (a stage is one node's devices: the intra-node link), plus its latency.

    As model/context.py runs it: forward, each of the ``cp - 1`` K/V transfers overlaps one block, costing
    ``max(0, transfer - block)``. Backward, the first block hides the next K/V, each middle one the next K/V and
    the previous block's float32 K/V gradients together (one link), the last one those gradients; the last
    gradients then travel home after the last block. Without overlap (``group.overlap`` false) every transfer
    is waited for: ``cp - 1`` forward, backward ``cp - 1`` K/V and gradients at once and the last gradients."""
    cp = group.cp
    if cp == 1:
        return 0.0, 0.0
    bw, lat = cost.link(group, group)
    nbytes = ring_bytes(cost, group, rows)
    if group.kind.pricing == ROOFLINE:
        attn_f, attn_b = cost.roofline.attention(group.kind, rows, group.tp, cp)
    else:  # the FLOP model: a backward twice the forward
        attn_f = rows * 2 * cost.square * cost.H / group.flops
        attn_b = 2 * attn_f
    kv, dkv = nbytes / bw + lat, nbytes * FLOAT32_BYTES / cost.act_bytes / bw + lat
    block_f, block_b = attn_f / cp, attn_b / cp
    if not group.overlap:
        return (cp - 1) * kv, (cp - 1) * (kv + dkv - lat) + dkv
    hidden = max(0.0, kv - block_b) + (cp - 2) * max(0.0, kv + dkv - lat - block_b) + max(0.0, dkv - block_b)
    return (cp - 1) * max(0.0, kv - block_f), hidden + dkv


def cp_sync_time(cost: Cost, cand: Candidate) -> float:
    """Seconds of the all-reduce of each stage's gradients over its CP ranks, the slowest stage's; 0 without CP."""
    worst = 0.0
    for p in cand.pipelines:
        n = len(p.stages)
        for i, s in enumerate(p.stages):
            if s.group.cp > 1:
                nbytes = cost.stage_params(s.group.tp, s.layers, i == 0, i == n - 1) * cost.grad_bytes
                worst = max(worst, cost.allreduce(nbytes, s.group.cp, cost.intra_bw(s.group)))
    return worst
