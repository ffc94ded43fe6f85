"""Gradient sync across pipelines: every finest common block summed among the ranks that hold it, and this
rank's share of the squared global gradient norm (docs/parallelism.md)."""

from __future__ import annotations

import torch

from hetero_llm.comm import collectives
from hetero_llm.comm.groups import Comms
from hetero_llm.comm.streams import NO_STREAMS, Streams
from hetero_llm.plan.rank import RankPlan
from hetero_llm.runtime.state import RankState


def _block_view(state: RankState, name: str, dim: int, lo: int, hi: int) -> torch.Tensor:
    """The gradient of global block [lo, hi) along ``dim`` of ``name``, in local coordinates."""
    _, shard_lo, _, _ = state.coords[name]
    return state.grad(name).narrow(dim, lo - shard_lo, hi - lo)


def _sum_sq(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """sum_i weights[i] * |tensors[i]|^2 as a float64 scalar on the tensors' device (no host sync).

    One multi-tensor norm kernel per distinct weight (on CUDA), not a few kernels per tensor.
    """
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
    for w in sorted(set(weights)):
        group = [t for t, tw in zip(tensors, weights) if tw == w]
        total = total + w * torch.stack(torch._foreach_norm(group)).double().pow(2).sum()
    return total


def sync_grads(rp: RankPlan, state: RankState, comms: Comms, streams: Streams = NO_STREAMS) -> torch.Tensor:
    """Sum every gradient block among its holders; return this rank's share of the squared global norm
    (a float64 scalar on the device, so the step syncs the host once, for the logged totals).

    A TP-replicated shard is scaled by 1/replicas first, so the sum counts each pipeline once. The norm
    counts every block once: each holder contributes 1/len(group) of the (identical) summed block.
    Every group's all-reduce is started first (on CUDA: on the grads stream), so they overlap one
    another and the local part of the norm.
    """
    pending = []
    for blocks in rp.sync_blocks:  # the sync block groups this rank is in
        views = [_block_view(state, name, dim, lo, hi) for name, dim, lo, hi in blocks.entries]
        scaled = [
            v / state.replicas[name] if state.replicas[name] > 1 else v
            for v, (name, *_rest) in zip(views, blocks.entries)
        ]
        pending.append((blocks, views, collectives.start_all_reduce_flat(comms, scaled, blocks.key, streams)))
    # TP-replicated shards are identical on the TP ranks of a stage: each counts 1/replicas.
    sq = _sum_sq([state.grad(n) for n in state.params], [1.0 / state.replicas[n] for n in state.params])
    for blocks, views, reduction in pending:
        summed = reduction.wait()
        share = 1.0 / len(blocks.group)
        sq = sq - _sum_sq(views, [1.0 / state.replicas[name] for name, *_rest in blocks.entries])
        sq = sq + _sum_sq(summed, [share] * len(summed))
        torch._foreach_copy_(views, summed)
    return sq
