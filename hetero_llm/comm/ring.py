"""The context-parallel (CP) ring: one stage's CP group passing key/value blocks around a circle.

CP rank ``i`` of ``n`` sends to ``(i + 1) % n`` and receives from ``(i - 1) % n``. A ``shift`` posts the receive
and the send at once and returns a handle: the caller computes on the block it holds while the next one
travels, and waits only when it needs it (``hetero_llm.model.context`` posts step s+1's transfer before it
computes step s). Every CP rank shifts the same tensors in the same order (the ring attention's steps, again when
a recomputed forward re-runs them), so sends and receives pair up by order; the tag keeps apart the streams
that travel at once (keys and values, their gradients).

NCCL: one ``batch_isend_irecv`` per shift on the group's own communicator (created eagerly by
``hetero_llm.comm.groups``), which runs on NCCL's stream; ``wait`` makes the compute stream wait for it. Gloo:
plain ``isend``/``irecv``; a CUDA tensor crosses through a host copy (``p2p.stages_through_host``). A ring of one
rank moves nothing: a shift hands back the tensors themselves.

``overlap`` (the layout's ``cp_overlap``) tells the attention whether to post a step's transfer before its blocks
(true) or after them, waiting for it at once (false). On emulated devices (``runtime/emulation.py``) ``pace``
makes each step's blocks last their modelled time while the posted transfer proceeds in gloo's background, as
on a GPU, and ``waits`` adds up the seconds spent waiting for transfers, which the rank's compute action does not
include (its modelled duration has no ring in it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.distributed as dist

from hetero_llm.comm.p2p import finish, started


@attrs.frozen(eq=False)
class Ring:
    """The CP group of one stage as a ring. ``ranks``: the group's global ranks in CP index order;
    ``index``: this rank's position in ``ranks``; ``group``: their process group (None: the default group,
    as in tests whose world is the ring)."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    index: int
    overlap: bool = True  # post each transfer before the blocks it travels beside (cp_overlap)
    # emulated devices: pace(t0, pairs, passes) sleeps until t0 plus the modelled seconds of ``pairs`` visible
    # query/key pairs (``passes``: 1 forward, 2 backward); None: real devices, no pacing
    pace: Callable[[float, int, int], None] | None = None
    waits: RingWaits | None = None  # emulated devices: where the seconds spent waiting for transfers add up

    @property
    def size(self) -> int:
        return len(self.ranks)

    def source(self, step: int) -> int:
        """The CP index whose block this rank holds after ``step`` shifts."""
        return (self.index - step) % self.size

    def shift(self, tensors: Sequence[torch.Tensor], tag: int) -> Shift:
        """Send ``tensors`` to the next rank and receive same-shaped ones from the previous (non-blocking).

        ``tag``: the stream's (tensor j goes as ``tag + j``), apart from stage-boundary tags (``p2p._tag``)."""
        if self.size == 1:
            return Shift([], list(tensors), [])
        nxt, prev = self.ranks[(self.index + 1) % self.size], self.ranks[(self.index - 1) % self.size]
        device = tensors[0].device
        staged = device.type != "cpu" and dist.get_backend(self.group) == "gloo"
        sends = [t.detach().contiguous() for t in tensors]
        if staged:
            sends = [t.cpu() for t in sends]  # complete on return: gloo reads host memory at once
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in sends]
        if device.type != "cpu" and not staged:
            ops = [dist.P2POp(dist.irecv, buf, prev, self.group, tag + j) for j, buf in enumerate(received)]
            ops += [dist.P2POp(dist.isend, t, nxt, self.group, tag + j) for j, t in enumerate(sends)]
            works = dist.batch_isend_irecv(ops)
        else:
            works = [started(dist.irecv(buf, prev, group=self.group, tag=tag + j)) for j, buf in enumerate(received)]
            works += [started(dist.isend(t, nxt, group=self.group, tag=tag + j)) for j, t in enumerate(sends)]
        return Shift(works, received, sends, device if staged else None, self.waits)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every CP rank's ``tensor`` (same shape on all), in CP index order."""
        if self.size == 1:
            return [tensor]
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(self.size)]
        dist.all_gather(out, tensor, group=self.group)
        return out


SOLO = Ring(None, (0,), 0)  # a ring of one rank: the whole row on this process


@attrs.define
class RingWaits:
    """Seconds a rank spent waiting for its ring's transfers (what an overlapped transfer did not hide)."""

    seconds: float = 0.0


@attrs.define(eq=False)
class Shift:
    """A shift in flight: ``wait()`` gives the received tensors (on the senders' device)."""

    works: list
    received: list[torch.Tensor]
    sent: list[torch.Tensor]  # kept alive until the sends complete
    device: torch.device | None = None  # staged through the host: where the received tensors go
    waits: RingWaits | None = None  # where the seconds of this wait add up (emulated devices)

    def wait(self) -> list[torch.Tensor]:
        """The received tensors, once here (again on a second call)."""
        t0 = time.perf_counter()
        for work in self.works:
            finish(work)
        if self.waits is not None and self.works:
            self.waits.seconds += time.perf_counter() - t0
        self.works, self.sent = [], []
        if self.device is not None:
            return [t.to(self.device) for t in self.received]
        return self.received
