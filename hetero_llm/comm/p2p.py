"""Stage-boundary p2p: a tensor crosses once, in pieces, and is all-gathered in the receiving group.

Sends and receives run over the groups ``hetero_llm.comm.groups`` created (or a shared-memory ring inside
a node, ``hetero_llm.comm.shm``); a receive is a ``PendingRecv`` the runtime polls and waits on. Also the
hot-switching exchange (one flat message to and from each peer).
"""

from __future__ import annotations

import threading
from typing import Protocol

import attrs
import torch
import torch.distributed as dist

from hetero_llm.comm.groups import PEER_WAIT, Comms
from hetero_llm.comm.streams import NO_STREAMS, Streams
from hetero_llm.plan import Route
from hetero_llm.schedule import Direction


def stages_through_host(device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
    """Gloo's send/recv read and write raw host memory, so a CUDA tensor crosses through a host copy (in
    ``group``; None: the default group, whose backend every plan group shares).

    This is what lets several ranks share one GPU (NCCL refuses that) with backend = 'gloo'. Gloo's
    collectives take CUDA tensors themselves (they copy through pinned memory on their own streams).
    """
    return device.type != "cpu" and dist.get_backend(group) == "gloo"


def _to_host(tensor: torch.Tensor, streams: Streams) -> torch.Tensor:
    """A host copy of ``tensor``, complete on return: copied on the p2p stream after the compute
    that produced it. The host waits for that compute: gloo's send reads the memory at once."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    streams.wait(streams.p2p, streams.compute)
    with streams.use(streams.p2p):
        host.copy_(tensor, non_blocking=True)
    streams.synchronize(streams.p2p)
    return host


def batched_p2p(device: torch.device) -> bool:
    """Whether a send or receive goes out as a (one-op) ``batch_isend_irecv``: with NCCL, yes.

    A batch runs on the group's own communicator, which ``groups.init`` created eagerly under the group's
    network settings; a lone ``isend``/``irecv`` makes NCCL build a 2-rank communicator per pair lazily,
    at the first message, under whatever settings are in force then (torch's PGNCCL). Gloo has no
    batches and no such communicators: plain ``isend``/``irecv``, which tests on CPU exercise.
    """
    return device.type != "cpu" and not stages_through_host(device)


def _p2p(op, tensor: torch.Tensor, peer: int, group, tag: int):
    """Start one send (``op = dist.isend``) or receive (``dist.irecv``) to or from global rank ``peer``."""
    if batched_p2p(tensor.device):
        works = dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group, tag)])
        return works[0]
    return op(tensor, peer, group=group, tag=tag)


class InFlight(Protocol):
    """A send or receive started: a process group's ``dist.Work`` or a shared-memory ring's (``shm_ring``)."""

    def wait(self) -> object: ...

    def is_completed(self) -> bool: ...


def finish(work: InFlight) -> None:
    """Wait for one send or receive (a process group's, or a shared-memory ring's) to complete.

    A gloo send or receive waits up to ``PEER_WAIT``, as long as its peer takes (``groups``' module doc): left
    to itself it would give up after the timeout its group was made with. NCCL's wait as they are: their
    ``wait(timeout)`` would block the host, and their timeout is the group's (``PEER_WAIT`` too).
    """
    if isinstance(work, dist.Work) and dist.get_backend() == "gloo":
        work.wait(PEER_WAIT)
    else:
        work.wait()


def started(work: dist.Work | None) -> dist.Work:
    """The work ``dist.isend`` or ``dist.irecv`` started: they return None only to a rank outside the group,
    which never posts one."""
    assert work is not None, "a send or receive posted by a rank outside its group"
    return work


def _tag(direction: Direction, mb: int, chunk: int, piece: int) -> int:
    return ((mb * 16 + chunk) * 2 + direction) * 64 + piece


def _piece_len(numel: int, pieces: int) -> int:
    return -(-numel // pieces)


def send_boundary(
    comms: Comms,
    tensor: torch.Tensor,
    routes: list[Route],
    direction: Direction,
    mb: int,
    chunk: int,
    streams: Streams = NO_STREAMS,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Send this rank's pieces of ``tensor`` (non-blocking; completed by ``wait_sends``) in ``group``
    (the boundary's p2p group; None: the default group). Ranks are global either way.

    NCCL sends from the device on its own stream, after the compute stream's work so far; gloo
    sends a host copy of a CUDA tensor (``stages_through_host``).
    """
    whole = tensor.detach().contiguous()
    flat = whole.view(-1)
    if stages_through_host(flat.device):
        flat = _to_host(flat, streams)  # one copy for all pieces
        whole = flat.view(whole.shape)
    for r in routes:
        if r.runs:  # re-chunking: the receiver's positions of this rank's (along dim 1, the sequence)
            piece = torch.cat([whole[:, lo : lo + k] for lo, _, k in r.runs], dim=1).reshape(-1)
        else:
            n = _piece_len(flat.numel(), r.pieces)
            piece = flat[r.piece * n : (r.piece + 1) * n]
            if piece.numel() < n:
                piece = torch.cat([piece, piece.new_zeros(n - piece.numel())])
        piece = piece.contiguous()
        tag, ring = _tag(direction, mb, chunk, r.piece), comms.shm.get((comms.rank, r.dst, direction))
        work = ring.send(piece, tag) if ring is not None else _p2p(dist.isend, piece, r.dst, group, tag)
        comms.pending_sends.append((work, piece))  # keep the buffer alive until sent


@attrs.define
class PendingRecv:
    work: InFlight
    buffer: torch.Tensor  # this rank's piece; a host copy-to-be when staged for gloo
    route: Route
    shape: tuple[int, ...]
    device: torch.device | None = None  # staged through host: the device the tensor goes to after arrival
    streams: Streams = NO_STREAMS
    _arrived: threading.Event | None = None
    _error: list = attrs.field(factory=list)

    def watch(self, notify: threading.Event | None = None) -> None:
        """Make ``arrived()`` pollable. Gloo's p2p Work only completes inside ``wait()``, so a daemon
        thread waits for it (and sets ``notify``, so an idle rank can sleep until something arrives);
        NCCL's ``is_completed()`` queries the CUDA event and needs no thread."""
        if self.buffer.is_cuda or self._arrived is not None:
            return
        self._arrived = threading.Event()

        def waiter(work=self.work, flag=self._arrived, error=self._error):
            try:
                finish(work)  # consumes gloo's completion: nobody may wait() on this work again
            except BaseException as e:  # handed to the main thread by wait()
                error.append(e)
            finally:
                flag.set()
                if notify is not None:
                    notify.set()

        threading.Thread(target=waiter, daemon=True).start()

    def arrived(self) -> bool:
        if self._arrived is not None:
            return self._arrived.is_set()
        return self.work.is_completed()

    def wait(self, comms: Comms) -> torch.Tensor:
        """The whole tensor, ready for the compute stream (the caller's current stream)."""
        s = self.streams
        if self._arrived is not None:
            self._arrived.wait()
            if self._error:
                raise self._error[0]
        else:
            finish(self.work)  # NCCL: the current (compute) stream waits for the receive; gloo: blocks
        if self.device is None:
            s.hand_over(self.buffer, s.compute)  # allocated on the p2p stream, read on the compute stream
        numel = 1
        for n in self.shape:
            numel *= n
        whole = self.buffer
        if self.route.pieces > 1:  # on the host when staged: only the whole tensor crosses to the device
            gathered = [torch.empty_like(self.buffer) for _ in range(self.route.pieces)]
            dist.all_gather(gathered, self.buffer, group=comms.tp_group)
            whole = torch.cat(gathered)
        out = whole[:numel].view(self.shape)
        if self.device is None:
            return out
        with s.use(s.p2p):
            out = out.to(self.device, non_blocking=True)
        s.wait(s.compute, s.p2p)
        s.hand_over(out, s.compute)
        return out


def recv_boundary(
    comms: Comms,
    route: Route,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    direction: Direction,
    mb: int,
    chunk: int,
    streams: Streams = NO_STREAMS,
    group: dist.ProcessGroup | None = None,
) -> PendingRecv:
    """Post the receive of this rank's piece (non-blocking); ``wait()`` on the result to use it.

    On CUDA the buffer is allocated and the receive posted on the p2p stream, so the receive does
    not wait for the compute queued before it; with gloo it lands in host memory (see
    ``stages_through_host``) and ``wait()`` copies it to the device.
    """
    numel = 1
    for n in shape:
        numel *= n
    tag = _tag(direction, mb, chunk, route.piece)
    if stages_through_host(comms.device):
        buf = torch.empty(_piece_len(numel, route.pieces), dtype=dtype, pin_memory=comms.device.type == "cuda")
        work = _irecv(comms, buf, route.src, group, tag, direction)
        return PendingRecv(work, buf, route, shape, device=comms.device, streams=streams)
    with streams.use(streams.p2p):
        buf = torch.empty(_piece_len(numel, route.pieces), dtype=dtype, device=comms.device)
        work = _irecv(comms, buf, route.src, group, tag, direction)
    return PendingRecv(work, buf, route, shape, streams=streams)


@attrs.define
class PendingRuns:
    """A receive that re-chunks (stages of different cp): one ``PendingRecv`` per sender (``recv_boundary`` of its
    route, ``runs_shape``), each of the runs of positions it holds, assembled into this rank's tensor; polled and
    waited on like a ``PendingRecv``."""

    parts: list[PendingRecv]
    shape: tuple[int, ...]

    def watch(self, notify: threading.Event | None = None) -> None:
        for part in self.parts:
            part.watch(notify)

    def arrived(self) -> bool:
        return all(part.arrived() for part in self.parts)

    def wait(self, comms: Comms) -> torch.Tensor:
        got = [part.wait(comms) for part in self.parts]
        out = torch.empty(self.shape, dtype=got[0].dtype, device=got[0].device)
        for part, t in zip(self.parts, got):
            at = 0
            for _, lo, k in part.route.runs:
                out[:, lo : lo + k] = t[:, at : at + k]
                at += k
        return out


def runs_shape(route: Route, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of what ``route`` (a re-chunking one) carries of a boundary tensor of ``shape``."""
    return (shape[0], sum(k for _, _, k in route.runs), *shape[2:])


def _irecv(comms: Comms, buf: torch.Tensor, src: int, group, tag: int, direction: Direction):
    """Post a receive on the shared-memory ring from ``src`` if there is one, else on the process group."""
    ring = comms.shm.get((src, comms.rank, direction))
    return ring.post(buf, tag) if ring is not None else _p2p(dist.irecv, buf, src, group, tag)


def wait_sends(comms: Comms) -> None:
    for work, _ in comms.pending_sends:
        finish(work)
    comms.pending_sends.clear()


# ------------------------------------------------------------------------------------------
# Hot switching: the batched exchange of parameters between two layouts' owners.


SWITCH_TAG = 1 << 20  # apart from every stage-boundary tag (_tag)


def exchange(
    sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor], group: dist.ProcessGroup | None = None
) -> None:
    """A switch's exchange: one flat message to and from each peer (global ranks), as one batched point-to-point
    (``dist.batch_isend_irecv``) in ``group`` (the switch group, ``groups.switch_group``; None: the default group),
    the receives then the sends, each in peer order, then a wait for all. Both sides list the same pairs (a switch
    plan every rank computes alike); a rank with nothing to move posts nothing.

    NCCL runs the batch as one group of sends and receives on the group's communicator, made before the first
    step, so a batch may involve any subset of the group's ranks; the wait makes the current stream wait for it.
    Gloo has no batches: the same list goes out as plain ``isend``/``irecv``, and a CUDA tensor crosses through a
    host copy (``stages_through_host``)."""
    if not sends and not receives:
        return
    device = next(iter({**sends, **receives}.values())).device
    staged = stages_through_host(device, group)
    out = {peer: buf.cpu() if staged else buf for peer, buf in sends.items()}  # .cpu(): waits for the packing
    into = {peer: torch.empty_like(buf, device="cpu") if staged else buf for peer, buf in receives.items()}
    ops = [dist.P2POp(dist.irecv, buf, peer, group, SWITCH_TAG) for peer, buf in sorted(into.items())]
    ops += [dist.P2POp(dist.isend, buf, peer, group, SWITCH_TAG) for peer, buf in sorted(out.items())]
    for work in dist.batch_isend_irecv(ops):
        finish(work)
    if staged:
        for peer, buf in receives.items():
            buf.copy_(into[peer])
