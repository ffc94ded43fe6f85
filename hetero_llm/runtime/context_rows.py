"""A context-parallel rank's part of every microbatch, and what its stage's ranks agree on.

A stage with ``cp`` > 1 cuts every row of every microbatch the same way: CP rank ``r`` holds positions
``cp_chunks.local_positions(seq_len, cp, r)`` (the zigzag chunks ``RankPlan.context`` names) of the tokens, the
targets and, for packed documents, of each token's document and position inside it. What it computes on is
those columns only (``ContextShard``: the ring attention sees the other ranks' keys); its summed loss is that of
its own targets, which the runtime divides by the global token count as without CP, so the CP ranks' losses and
gradients add up to the whole rows'.
"""

from __future__ import annotations

import time

import attrs
import numpy as np
import torch
import torch.distributed as dist

from hetero_llm.comm.groups import Comms
from hetero_llm.comm.ring import Ring, RingWaits
from hetero_llm.model import cp_chunks
from hetero_llm.model.context import ContextShard
from hetero_llm.plan.rank import RankPlan
from hetero_llm.predict.device import EmulatedDevice
from hetero_llm.schedule import Kind


def ring_of(rp: RankPlan, comms: Comms) -> Ring | None:
    """The rank's CP group as a ring (None: its stage has cp 1)."""
    ctx = rp.context
    return Ring(comms.groups[ctx.group], ctx.ranks, ctx.index, ctx.overlap) if ctx is not None else None


def emulated_ring(ring: Ring, model, tp: int, device: EmulatedDevice | None) -> Ring:
    """``ring`` on an emulated rank: its transfers' waits counted (``RingWaits``: the compute action's modelled
    duration leaves them out, so what a transfer does not hide lengthens the action, as on a GPU) and, on a
    modelled device, each ring step's attention blocks paced to their modelled seconds, ``4 H`` FLOPs per visible
    query/key pair (its score and its weighted value), ``2 x`` that backward, split over the TP group (as
    ``predict.device.action_seconds`` charges the rows' attention, ``square_sum`` ~ twice the visible pairs),
    while the step's posted transfer travels in gloo's background."""
    if device is None:
        return attrs.evolve(ring, waits=RingWaits())
    per_pair = 4 * model.hidden / (tp * device.flops)

    def pace(t0: float, pairs: int, passes: int) -> None:
        time.sleep(max(0.0, t0 + passes * pairs * per_pair - time.perf_counter()))

    return attrs.evolve(ring, pace=pace, waits=RingWaits())


def context_columns(
    ring: Ring,
    seq_len: int,
    inputs: np.ndarray,
    targets: np.ndarray,
    spans: np.ndarray | None = None,
    positions: np.ndarray | None = None,
) -> tuple[torch.Tensor, torch.Tensor, ContextShard]:
    """This CP rank's columns of (B, seq_len) ``inputs`` and ``targets``, and its ``ContextShard``.

    ``spans`` (documents, 3) of (row, start, length) and ``positions`` (B, seq_len): the rows are packed
    documents (``documents.PackedRows``); each local token then carries its document's index (-1 at padding)
    and its position inside it. Without them every row is one causal sequence at its global positions.
    """
    if inputs.shape[1] != seq_len:  # rows are seq_len wide: the chunks cut exactly these positions
        raise ValueError(f"context-parallel rows must be {seq_len} wide, got {inputs.shape[1]}")
    held = cp_chunks.local_positions(seq_len, ring.size, ring.index)
    rows = inputs.shape[0]
    if spans is not None:
        assert positions is not None  # packed rows carry both
        doc = cp_chunks.document_ids(spans, rows, seq_len)
        doc_t: torch.Tensor | None = torch.from_numpy(np.ascontiguousarray(doc[:, held]))
        where = np.ascontiguousarray(positions[:, held])
    else:
        doc_t, where = None, np.ascontiguousarray(np.broadcast_to(held, (rows, len(held))))
    shard = ContextShard(ring, torch.from_numpy(held), doc_t, torch.from_numpy(where))
    columns = [torch.from_numpy(np.ascontiguousarray(a[:, held])) for a in (inputs, targets)]
    return columns[0], columns[1], shard


def attention_square(shard: ContextShard) -> int:
    """This CP rank's share of its rows' attention work, in the units of ``DocumentMask.square_sum`` (what
    ``predict.device.action_seconds`` charges for attention): the sum over its local queries of ``2 k - 1``, ``k``
    the keys the query sees (its position in its document, or in the row, plus one; 0 at padding). Over a whole
    document of n tokens that is n^2, so the CP ranks' shares add up to the rows' square sum; under zigzag each
    rank's share of a causal row of S positions is S^2 / cp."""
    weight = 2 * shard.positions.cpu() + 1
    if shard.doc is not None:
        weight = weight * (shard.doc.cpu() >= 0)
    return int(weight.sum())


def shard_to(shard: ContextShard, device: torch.device) -> ContextShard:
    """``shard`` with its tensors on ``device``."""
    doc = shard.doc.to(device, non_blocking=True) if shard.doc is not None else None
    return ContextShard(
        shard.ring, shard.q_pos.to(device, non_blocking=True), doc, shard.positions.to(device, non_blocking=True)
    )


def cp_agree(ring: Ring, choice: tuple[Kind, int] | None, device: torch.device) -> tuple[Kind, int]:
    """CP rank 0's choice of the next dynamic action on every CP rank of the ring, the others passing None
    (CP rank 0's TP group agreed first: the stage's TP x CP ranks then run the same actions, their collectives
    pairing up)."""
    t = torch.zeros(2, dtype=torch.int64, device=device)
    if choice is not None:
        t[0], t[1] = (0 if choice[0] is Kind.F else 1), choice[1]
    dist.broadcast(t, src=ring.ranks[0], group=ring.group)
    return (Kind.F if int(t[0]) == 0 else Kind.B), int(t[1])
