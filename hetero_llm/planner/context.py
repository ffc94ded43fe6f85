"""Context parallelism in the planner: what a stage's CP ranks add to its time, and the search's CP start points.
Torch-free.

A stage of ``cp`` > 1 (the layout's ``[[pipelines.stages]] cp``; ``candidates.TPGroup.cp``) holds ``1 / cp`` of
every sequence's tokens on each of its CP ranks, a TP group each (zigzag chunks r and 2 cp - 1 - r: model/cp_chunks.py),
so its matmuls, element-wise work, TP all-reduces, activations and logits are ``1 / cp`` of a TP group's
(roofline.py, cost.py, memory.py). The attention of a rank's queries meets every key once, passing keys and
values round a ring (Megatron-LM's and torchtitan's ring attention), which adds:

- per layer, ``cp - 1`` ring steps forward, each rank sending its K/V chunk (``ring_bytes``) to its neighbour over
  the link between them; backward twice the bytes (K, V and their gradients). Each step overlaps one of the
  ``cp`` blocks the rank's attention runs in: it costs what the block does not hide (``ring_exposed``);
- the all-reduce of the stage's gradients over its CP ranks, which hold the same weights (``cp_sync_time``),
  over the intra-node link, before the sync between pipelines.

The search's CP moves and start points are in move_parts.py (``reshaped``, ``with_cp``) and moves.py.
"""

from __future__ import annotations

from typing import Any

from hetero_llm.planner.candidates import Candidate, TPGroup
from hetero_llm.planner.catalogue import ROOFLINE

# ``cost``: a cost.PlannerCostModel (not imported, not even for type checking: cost.py imports this module)
Cost = Any


def ring_bytes(cost: Cost, group: TPGroup, rows: int) -> float:
    """Bytes one CP rank sends its ring neighbour per step of one layer's forward: its K and V chunk,
    ``2 x rows S / cp x kv_heads / tp x head_dim x`` the activation bytes."""
    m = cost.model
    return 2 * rows * cost.S / group.cp * m.kv_heads_n / group.tp * m.head_dim * cost.act_bytes


def ring_exposed(cost: Cost, group: TPGroup, rows: int) -> tuple[float, float]:
    """(forward, backward) seconds per layer of the ring that the attention does not hide: a rank's attention
    runs in ``cp`` blocks (its queries against each K/V chunk in turn) and each of the ``cp - 1`` transfers
    overlaps one block, costing ``max(0, transfer - block)``; a transfer crosses the link between ring
    neighbours (a stage is one node's devices: the intra-node link), plus its latency."""
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
    step_f, step_b = nbytes / bw + lat, 2 * nbytes / bw + lat
    return (cp - 1) * max(0.0, step_f - attn_f / cp), (cp - 1) * max(0.0, step_b - attn_b / cp)


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
