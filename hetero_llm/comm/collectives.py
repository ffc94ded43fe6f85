"""Collectives: Megatron's TP operators and agreement, gradient-sync all-reduce, ZeRO-1's reduce-scatter
and all-gather, world reductions. Each runs over a group ``hetero_llm.comm.groups`` created; gradient sync
and ZeRO-1 run on the grads stream (``hetero_llm.comm.streams``) so they overlap compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import torch
import torch.distributed as dist

from hetero_llm.comm.groups import Comms
from hetero_llm.comm.streams import NO_STREAMS, Streams
from hetero_llm.model.forward import TP
from hetero_llm.plan.rank import GroupKey
from hetero_llm.schedule import Kind

# ------------------------------------------------------------------------------------------
# Tensor parallel operators (Megatron f / g), and TP rank 0's choice shared with its group.


def tp_index(comms: Comms) -> int:
    return comms.tp_ranks.index(comms.rank)


def tp_agree(comms: Comms, choice: tuple[Kind, int] | None) -> tuple[Kind, int]:
    """TP rank 0's choice of the next dynamic action (``Kind.F`` or ``Kind.B``, microbatch), on every rank of
    the TP group; the others pass None."""
    t = torch.zeros(2, dtype=torch.int64, device=comms.device)
    if choice is not None:
        t[0], t[1] = (0 if choice[0] is Kind.F else 1), choice[1]
    dist.broadcast(t, src=comms.tp_ranks[0], group=comms.tp_group)
    return (Kind.F if int(t[0]) == 0 else Kind.B), int(t[1])


@attrs.define
class TpWaits:
    """Seconds this rank spent inside its TP all-reduces, waiting for its TP peers included (on CUDA, until the
    device finished them). Emulated slowdown (runtime/emulation.py) stretches a compute action by a factor of
    its own compute time, so it must leave this out: stretched, a wait for the peer's emulated sleep makes this
    rank sleep longer, then the peer waits for that, and every action multiplies the TP ranks' skew by the
    slowdown (a step that never ends). Only measured while emulating (it synchronizes CUDA devices)."""

    seconds: float = 0.0

    def all_reduce(self, x: torch.Tensor, group) -> None:
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.seconds += time.perf_counter() - t0


def _tp_all_reduce(x: torch.Tensor, group, waits: TpWaits | None) -> None:
    if waits is None:
        dist.all_reduce(x, group=group)
    else:
        waits.all_reduce(x, group)


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, waits):
        ctx.group, ctx.waits = group, waits
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        _tp_all_reduce(g, ctx.group, ctx.waits)
        return g, None, None


class _Exit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, waits):
        x = x.contiguous().clone()
        _tp_all_reduce(x, group, waits)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def tp_ops(comms: Comms, waits: TpWaits | None = None) -> TP:
    """Megatron's f and g over the rank's TP group (``NO_TP`` without one); ``waits``: where to add the
    seconds spent in their all-reduces (emulated runs)."""
    from hetero_llm.model.forward import NO_TP

    if comms.tp_group is None:
        return NO_TP
    group = comms.tp_group
    return TP(lambda x: _Enter.apply(x, group, waits), lambda x: _Exit.apply(x, group, waits))


# ------------------------------------------------------------------------------------------
# Reductions


@attrs.define
class PendingReduce:
    work: dist.Work | _Works | None  # None for CuPy: its all-reduce is ordered on the grads stream, nothing to wait on
    flat: torch.Tensor
    shapes: list[torch.Size]
    streams: Streams

    def wait(self) -> list[torch.Tensor]:
        """The summed tensors, ready for the compute stream (views into one flat buffer)."""
        s = self.streams
        if self.work is not None:
            self.work.wait()  # NCCL / gloo on CUDA: the current stream waits; gloo on CPU: blocks
        s.wait(s.compute, s.grads)
        s.hand_over(self.flat, s.compute)
        out, offset = [], 0
        for shape in self.shapes:
            n = shape.numel()
            out.append(self.flat[offset : offset + n].view(shape))
            offset += n
        return out


def start_all_reduce_flat(
    comms: Comms, tensors: list[torch.Tensor], group: GroupKey, streams: Streams = NO_STREAMS
) -> PendingReduce:
    """Start summing ``tensors`` among the group in one collective; ``wait()`` gives the sums.

    On CUDA the packing and the all-reduce run on the grads stream, after the compute stream's work
    so far (the gradients are final there), and overlap what the compute stream does next.
    """
    streams.wait(streams.grads, streams.compute)
    cupy_group = comms.cupy.get(group)
    with streams.use(streams.grads):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if cupy_group is not None:
            cupy_group.all_reduce(flat)  # on torch's current stream: the grads stream
            work = None
        else:
            work = dist.all_reduce(flat, group=comms.groups[group], async_op=True)
    for t in tensors:
        streams.hand_over(t, streams.grads)  # read on the grads stream; the caller may drop them now
    return PendingReduce(work, flat, [t.shape for t in tensors], streams)


def all_reduce_world(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def barrier() -> None:
    dist.barrier()


# ------------------------------------------------------------------------------------------
# ZeRO-1 (hetero_llm/runtime/zero1.py): reduce-scatter of gradient blocks, all-gather of updated parameters.
# torch 2.13 renamed the *_tensor collectives *_single; both take (output, input) of equal chunks.
# Gloo copies a whole reduce-scatter's input and all-gather's output inside (50 MB in: +73 MB and +192 MB of
# peak memory, measured on CPU), which would cancel what ZeRO-1 saves. So on gloo (CPU tensors) both are a
# direct exchange of send/receive pairs: each member sends every other member that member's chunk and
# receives its own chunk from each (the reduce-scatter sums them when waited for; the all-gather receives in
# place). Each member sends (n-1)/n of the buffer, what a ring sends, once each way, concurrently. (It was
# one gloo reduce and one broadcast per member: 1.25x the bytes and 1.8x the time of a ring all-reduce
# between two testbed nodes, more where a device is in two groups: bench/comm/gloo_collectives.py.) NCCL runs
# the collectives themselves.

_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@attrs.frozen
class _Works:
    """Several started point-to-point operations, waited for as one; then ``then`` (if any) runs."""

    works: tuple
    then: Callable[[], None] | None = None

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        if self.then is not None:
            self.then()


def _exchange(group, members: list[int], rank: int, recv_into, send_piece) -> tuple:
    """A receive into ``recv_into(j)`` and a send of ``send_piece(j)`` with every other member j, all posted."""
    me = members.index(rank)
    works = []
    for j, r in enumerate(members):
        if j != me:
            works.append(dist.irecv(recv_into(j), src=r, group=group))
            works.append(dist.isend(send_piece(j), dst=r, group=group))
    return tuple(works)


def exchange_reduce_scatter(flat: torch.Tensor, group, members: list[int], rank: int) -> tuple[_Works, torch.Tensor]:
    """Gloo's reduce-scatter: ``flat`` holds one equal chunk per member (in ``members`` order); this rank sends
    chunk j to member j and receives the others' copies of its own chunk, summed into its chunk (a view of
    ``flat``) in member order when the returned work is waited for. Temporary memory: (n-1) chunks."""
    n = flat.numel() // len(members)
    pieces = flat.view(len(members), n)
    out = pieces[members.index(rank)]
    received = {j: flat.new_empty(n) for j, r in enumerate(members) if r != rank}
    works = _exchange(group, members, rank, received.__getitem__, pieces.__getitem__)

    def add() -> None:
        for buffer in received.values():
            out.add_(buffer)
        received.clear()

    return _Works(works, add), out


def exchange_all_gather(out: torch.Tensor, group, members: list[int], rank: int) -> _Works:
    """Gloo's all-gather, in place: ``out`` holds one equal chunk per member, this rank's already written;
    it is sent to every other member, and theirs are received into their chunks."""
    pieces = out.view(len(members), out.numel() // len(members))
    mine = pieces[members.index(rank)]
    return _Works(_exchange(group, members, rank, pieces.__getitem__, lambda j: mine))


def start_reduce_scatter(
    comms: Comms, flat: torch.Tensor, key: GroupKey, streams: Streams = NO_STREAMS
) -> PendingReduce:
    """Start summing ``flat`` (one equal chunk per group member, in group rank order) among the group;
    ``wait()`` gives this rank's summed chunk (on gloo: a view into ``flat``). On CUDA it runs on the grads
    stream, after the backward."""
    group = comms.groups[key]
    members = dist.get_process_group_ranks(group)
    n = flat.numel() // len(members)
    streams.wait(streams.grads, streams.compute)
    with streams.use(streams.grads):
        if dist.get_backend(group) == "gloo":
            work, out = exchange_reduce_scatter(flat, group, members, comms.rank)
        else:
            out = flat.new_empty(n)
            work = _reduce_scatter(out, flat, group=group, async_op=True)
    streams.hand_over(flat, streams.grads)
    return PendingReduce(work, out, [out.shape], streams)


def start_all_gather(comms: Comms, chunk: torch.Tensor, key: GroupKey, streams: Streams = NO_STREAMS) -> PendingReduce:
    """Start gathering every member's ``chunk`` (equal sizes) into one flat tensor, in group rank order;
    ``wait()`` gives it."""
    group = comms.groups[key]
    members = dist.get_process_group_ranks(group)
    streams.wait(streams.grads, streams.compute)
    with streams.use(streams.grads):
        out = chunk.new_empty(chunk.numel() * len(members))
        if dist.get_backend(group) == "gloo":
            out.view(len(members), chunk.numel())[members.index(comms.rank)].copy_(chunk)
            work = exchange_all_gather(out, group, members, comms.rank)
        else:
            work = _all_gather(out, chunk, group=group, async_op=True)
    streams.hand_over(chunk, streams.grads)
    return PendingReduce(work, out, [out.shape], streams)
