"""Every communication call of the runtime: rendezvous, groups, TP collectives, stage p2p, grad sync.

Communicators are values built once from the pure plan, on every rank in the same order, named for
their job. Nothing here keeps module globals: a ``Comms`` record is passed to whoever needs it.
Written device-agnostic: gloo on CPU, NCCL on CUDA, same calls.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import attrs
import torch
import torch.distributed as dist

from hetero_llm import shm
from hetero_llm.errors import RankFailure
from hetero_llm.layout import CommLib
from hetero_llm.model import TP
from hetero_llm.plan import Group, Plan, Route
from hetero_llm.rendezvous import rendezvous


@attrs.define
class Comms:
    rank: int
    world_size: int
    device: torch.device
    groups: dict[str, dist.ProcessGroup]  # by plan group name
    tp_group: dist.ProcessGroup | None  # this rank's TP group (None when TP size is 1)
    tp_ranks: tuple[int, ...]  # global ranks of this rank's TP group, TP index order
    pending_sends: list = attrs.field(factory=list)
    cupy: dict = attrs.field(factory=dict)  # group name -> CupyGroup, for cluster.comm = 'cupy'
    shm: dict = attrs.field(factory=dict)  # (src, dst, direction) -> this rank's end of a shared-memory ring


def init(plan: Plan, rank: int, device: torch.device, agree: str = "") -> Comms:
    """Rendezvous, the default group, then every plan group in plan order (on every rank).

    Each group is created under its transport's network settings (``Plan.group_env``: its domain's,
    or the cross-domain network's when it spans domains), which are restored right after: gloo binds
    the group's sockets to GLOO_SOCKET_IFNAME when the group is constructed, NCCL reads its variables
    when the communicator is created, which we force at once with a one-element all-reduce.
    """
    store = rendezvous(plan, rank, agree)  # hetero_llm.rendezvous: where the store is, who serves it
    cluster = plan.layout.cluster
    backend = cluster.backend.value
    timeout = timedelta(seconds=max(cluster.timeout_s, 30))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = plan.world
    with _network_env(plan, rank, world):
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=plan.world_size,
                                timeout=timeout, pg_options=_pg_options(plan, rank, world))
        _connect(None, device, backend)
    groups: dict[str, dist.ProcessGroup] = {}
    for g in plan.groups:
        with _network_env(plan, rank, g):
            groups[g.name] = dist.new_group(list(g.ranks), timeout=timeout, pg_options=_pg_options(plan, rank, g))
            if rank in g.ranks:
                _connect(groups[g.name], device, backend)
    cupy_groups = _cupy_groups(plan, rank, store, device) if cluster.comm is CommLib.CUPY else {}
    rings = shm.connect(plan, rank, store, timeout.total_seconds())  # boundaries inside a node (their groups stay: fallback)
    _warn_missing_interfaces(plan, rank)
    st = plan.stage_of(rank)
    tp_group = groups.get(f"tp[{st.label}]")
    # Force the lazily-connecting backends to connect now, in plan order, on every rank.
    dist.barrier()
    return Comms(rank, plan.world_size, device, groups, tp_group, st.ranks, cupy=cupy_groups, shm=rings)


def has_interface(name: str) -> bool:
    try:
        socket.if_nametoindex(name)
        return True
    except OSError:
        return False


def group_env(plan: Plan, rank: int, group: Group) -> dict[str, str]:
    """``Plan.group_env`` minus a gloo interface this host lacks (plain CPU runs: the default applies)."""
    env = plan.group_env(rank, group)
    if "GLOO_SOCKET_IFNAME" in env and not has_interface(env["GLOO_SOCKET_IFNAME"]):
        del env["GLOO_SOCKET_IFNAME"]
    return env


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """Set ``env`` in os.environ for the duration; restore the previous values (or absence) after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _network_env(plan: Plan, rank: int, group: Group):
    """The group's network variables, set while it is created (nothing for a rank outside it)."""
    return environment(group_env(plan, rank, group) if rank in group.ranks else {})


def _pg_options(plan: Plan, rank: int, group: Group):
    """NCCL: per-communicator options carrying the transport's net (``config.net_name``, where this
    torch and NCCL have it; the NCCL_NET variable set around creation covers older ones). Gloo: None,
    since torch's new_group ignores gloo options (it builds the device from GLOO_SOCKET_IFNAME)."""
    if plan.layout.cluster.backend.value != "nccl" or rank not in group.ranks:
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    net = plan.group_env(rank, group).get("NCCL_NET")
    config = getattr(opts, "config", None)
    if net and config is not None and hasattr(config, "net_name"):
        config.net_name = net
        opts.config = config
    return opts


def _connect(group, device: torch.device, backend: str) -> None:
    """NCCL creates a communicator at its first collective: do one now, while the group's variables are set."""
    if backend != "nccl":
        return  # gloo connects its full mesh when the group is constructed
    t = torch.zeros(1, device=device)
    dist.all_reduce(t, group=group)
    torch.cuda.synchronize(device)


def _warn_missing_interfaces(plan: Plan, rank: int) -> None:
    """One line per node (from its first rank) naming the layout's gloo interfaces this host lacks."""
    node = plan.ranks[rank].node
    local = [r.rank for r in plan.ranks if r.node == node]
    if rank != local[0]:
        return
    wanted: dict[str, set[str]] = {}
    for g in (plan.world,) + plan.groups:
        for r in set(local) & set(g.ranks):
            name = plan.group_env(r, g).get("GLOO_SOCKET_IFNAME")
            if name:
                wanted.setdefault(name, set()).add(g.transport)
    missing = [f"{name} ({', '.join(sorted(t))})" for name, t in sorted(wanted.items()) if not has_interface(name)]
    if missing:
        sys.stderr.write(f"warning: {node}: no network interface {', '.join(missing)} on this host; those groups "
                         "use the default interface (expected on a plain CPU run; on a cluster, check gloo_ifname)\n")
        sys.stderr.flush()


# ------------------------------------------------------------------------------------------
# CuPy NCCL communicators for gradient sync (cluster.comm = 'cupy'): our own NCCL comms, one per
# gradient-sync group, created with the group's domain settings, run on torch's current stream.


@attrs.frozen
class CupyGroup:
    comm: object  # cupy.cuda.nccl.NcclCommunicator
    ranks: tuple[int, ...]

    def all_reduce(self, flat: torch.Tensor) -> None:
        """In-place sum of a contiguous CUDA tensor, by its data pointer, on torch's current stream."""
        from cupy.cuda import nccl

        kinds = {torch.float32: nccl.NCCL_FLOAT32, torch.float64: nccl.NCCL_FLOAT64, torch.float16: nccl.NCCL_FLOAT16}
        if hasattr(nccl, "NCCL_BFLOAT16"):
            kinds[torch.bfloat16] = nccl.NCCL_BFLOAT16
        if flat.dtype not in kinds or not flat.is_cuda or not flat.is_contiguous():
            raise RankFailure(f"CuPy all-reduce needs a contiguous CUDA tensor of {sorted(map(str, kinds))}, "
                              f"got {flat.dtype} on {flat.device}")
        stream = torch.cuda.current_stream(flat.device).cuda_stream
        self.comm.allReduce(flat.data_ptr(), flat.data_ptr(), flat.numel(), kinds[flat.dtype], nccl.NCCL_SUM, stream)


def _cupy():
    try:
        import cupy
        from cupy.cuda import nccl  # noqa: F401  (CuPy built without NCCL fails here)
    except ImportError as e:
        raise RankFailure(f"cluster.comm = 'cupy' but CuPy with NCCL is not importable here ({e}) "
                          "(pip install 'hetero_llm[cupy]', or set comm = 'torch')") from None
    return cupy


def make_cupy_group(store: dist.Store, name: str, ranks: tuple[int, ...], rank: int, env: dict[str, str]) -> CupyGroup:
    """One NCCL communicator among ``ranks``: the first member makes the unique id, the store carries it."""
    nccl = _cupy().cuda.nccl
    key = f"cupy_nccl/{name}"
    me = ranks.index(rank)
    if me == 0:
        store.set(key, json.dumps(list(nccl.get_unique_id())))
    uid = tuple(json.loads(store.get(key)))  # get() waits until the key is there
    with environment(env):
        comm = nccl.NcclCommunicator(len(ranks), uid, me)  # blocking: NCCL reads its variables here
    return CupyGroup(comm, ranks)


def _cupy_groups(plan: Plan, rank: int, store: dist.Store, device: torch.device) -> dict[str, CupyGroup]:
    """Every gradient-sync group this rank is in, in plan order (each init waits for all its members)."""
    out = {}
    grad_sync = {b.name for b in plan.buckets}
    with _cupy().cuda.Device(device.index if device.index is not None else 0):
        for g in plan.groups:
            if g.name in grad_sync and rank in g.ranks:
                out[g.name] = make_cupy_group(store, g.name, g.ranks, rank, group_env(plan, rank, g))
    return out


def tp_index(comms: Comms) -> int:
    return comms.tp_ranks.index(comms.rank)


def tp_agree(comms: Comms, choice: tuple[str, int] | None) -> tuple[str, int]:
    """TP rank 0's choice of the next dynamic action, on every rank of the TP group."""
    t = torch.zeros(2, dtype=torch.int64, device=comms.device)
    if choice is not None:
        t[0], t[1] = (0 if choice[0] == "F" else 1), choice[1]
    dist.broadcast(t, src=comms.tp_ranks[0], group=comms.tp_group)
    return ("F" if int(t[0]) == 0 else "B"), int(t[1])


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------
# Tensor parallel operators (Megatron f / g)


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _Exit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def tp_ops(comms: Comms) -> TP:
    from hetero_llm.model import NO_TP

    if comms.tp_group is None:
        return NO_TP
    group = comms.tp_group
    return TP(lambda x: _Enter.apply(x, group), lambda x: _Exit.apply(x, group))


# ------------------------------------------------------------------------------------------
# CUDA streams beside the compute stream, and host staging for gloo's p2p.


class Streams:
    """Side CUDA streams for communication, so it overlaps compute; on CPU none, and no-ops.

    ``p2p`` carries stage-boundary receives (and the host copies of gloo staging), ``grads`` the
    packing and all-reduce of gradient sync. Every hand-over between streams is explicit: the
    consumer stream waits for the producer (``wait``), and a tensor allocated on one stream and used
    on another is recorded on the user (``hand_over``) so the caching allocator does not reuse its
    memory while that stream may still read it. Tests pass a fake with the same methods to check
    the order of these calls on CPU.
    """

    def __init__(self, device: torch.device):
        self.active = device.type == "cuda"
        cuda = torch.cuda if self.active else None
        self.compute = cuda.current_stream(device) if cuda else None
        self.p2p = cuda.Stream(device) if cuda else None
        self.grads = cuda.Stream(device) if cuda else None

    def use(self, stream) -> contextlib.AbstractContextManager:
        """Make ``stream`` current for the kernels (and NCCL calls) issued inside."""
        return torch.cuda.stream(stream) if self.active else contextlib.nullcontext()

    def wait(self, waiter, producer) -> None:
        """Work issued on ``waiter`` from now on starts after all work issued on ``producer`` so far."""
        if self.active:
            waiter.wait_stream(producer)

    def hand_over(self, tensor: torch.Tensor, stream) -> None:
        if self.active:
            tensor.record_stream(stream)

    def synchronize(self, stream) -> None:
        """Block the host until ``stream`` is done (gloo reads host memory the moment it is called)."""
        if self.active:
            stream.synchronize()


NO_STREAMS = Streams(torch.device("cpu"))


def stages_through_host(device: torch.device) -> bool:
    """Gloo's send/recv read and write raw host memory, so a CUDA tensor crosses through a host copy.

    This is what lets several ranks share one GPU (NCCL refuses that) with backend = 'gloo'. Gloo's
    collectives take CUDA tensors themselves (they copy through pinned memory on their own streams).
    """
    return device.type != "cpu" and dist.get_backend() == "gloo"


def _to_host(tensor: torch.Tensor, streams: Streams) -> torch.Tensor:
    """A host copy of ``tensor``, complete on return: copied on the p2p stream after the compute
    that produced it. The host waits for that compute: gloo's send reads the memory at once."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    streams.wait(streams.p2p, streams.compute)
    with streams.use(streams.p2p):
        host.copy_(tensor, non_blocking=True)
    streams.synchronize(streams.p2p)
    return host


# ------------------------------------------------------------------------------------------
# Stage-boundary p2p: a tensor crosses once, in pieces, and is all-gathered in the receiving group.


def batched_p2p(device: torch.device) -> bool:
    """Whether a send or receive goes out as a (one-op) ``batch_isend_irecv``: with NCCL, yes.

    A batch runs on the group's own communicator, which ``init`` created eagerly under the group's
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


def _tag(direction: int, mb: int, chunk: int, piece: int) -> int:
    return ((mb * 16 + chunk) * 2 + direction) * 64 + piece


def _piece_len(numel: int, pieces: int) -> int:
    return -(-numel // pieces)


def send_boundary(comms: Comms, tensor: torch.Tensor, routes: list[Route], direction: int, mb: int, chunk: int,
                  streams: Streams = NO_STREAMS, group: dist.ProcessGroup | None = None) -> None:
    """Send this rank's pieces of ``tensor`` (non-blocking; completed by ``wait_sends``) in ``group``
    (the boundary's p2p group; None: the default group). Ranks are global either way.

    NCCL sends from the device on its own stream, after the compute stream's work so far; gloo
    sends a host copy of a CUDA tensor (``stages_through_host``).
    """
    flat = tensor.detach().contiguous().view(-1)
    if stages_through_host(flat.device):
        flat = _to_host(flat, streams)  # one copy for all pieces
    for r in routes:
        n = _piece_len(flat.numel(), r.pieces)
        piece = flat[r.piece * n:(r.piece + 1) * n]
        if piece.numel() < n:
            piece = torch.cat([piece, piece.new_zeros(n - piece.numel())])
        piece = piece.contiguous()
        tag, ring = _tag(direction, mb, chunk, r.piece), comms.shm.get((comms.rank, r.dst, direction))
        work = ring.send(piece, tag) if ring is not None else _p2p(dist.isend, piece, r.dst, group, tag)
        comms.pending_sends.append((work, piece))  # keep the buffer alive until sent


@attrs.define
class PendingRecv:
    work: object
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
                work.wait()  # consumes gloo's completion: nobody may wait() on this work again
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
            self.work.wait()  # NCCL: the current (compute) stream waits for the receive; gloo: blocks
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


def recv_boundary(comms: Comms, route: Route, shape: tuple[int, ...], dtype: torch.dtype,
                  direction: int, mb: int, chunk: int, streams: Streams = NO_STREAMS,
                  group: dist.ProcessGroup | None = None) -> PendingRecv:
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


def _irecv(comms: Comms, buf: torch.Tensor, src: int, group, tag: int, direction: int):
    """Post a receive on the shared-memory ring from ``src`` if there is one, else on the process group."""
    ring = comms.shm.get((src, comms.rank, direction))
    return ring.post(buf, tag) if ring is not None else _p2p(dist.irecv, buf, src, group, tag)


def wait_sends(comms: Comms) -> None:
    for work, _ in comms.pending_sends:
        work.wait()
    comms.pending_sends.clear()


# ------------------------------------------------------------------------------------------
# Reductions


@attrs.define
class PendingReduce:
    work: object | None  # None for CuPy: its all-reduce is ordered on the grads stream, nothing to wait on
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
            out.append(self.flat[offset:offset + n].view(shape))
            offset += n
        return out


def start_all_reduce_flat(comms: Comms, tensors: list[torch.Tensor], group_name: str,
                          streams: Streams = NO_STREAMS) -> PendingReduce:
    """Start summing ``tensors`` among the group in one collective; ``wait()`` gives the sums.

    On CUDA the packing and the all-reduce run on the grads stream, after the compute stream's work
    so far (the gradients are final there), and overlap what the compute stream does next.
    """
    streams.wait(streams.grads, streams.compute)
    cupy_group = comms.cupy.get(group_name)
    with streams.use(streams.grads):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if cupy_group is not None:
            cupy_group.all_reduce(flat)  # on torch's current stream: the grads stream
            work = None
        else:
            work = dist.all_reduce(flat, group=comms.groups[group_name], async_op=True)
    for t in tensors:
        streams.hand_over(t, streams.grads)  # read on the grads stream; the caller may drop them now
    return PendingReduce(work, flat, [t.shape for t in tensors], streams)


def all_reduce_flat(comms: Comms, tensors: list[torch.Tensor], group_name: str,
                    streams: Streams = NO_STREAMS) -> list[torch.Tensor]:
    """Sum ``tensors`` among the group in one collective; returns the summed tensors."""
    return start_all_reduce_flat(comms, tensors, group_name, streams).wait()


def all_reduce_world(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def barrier() -> None:
    dist.barrier()


# ------------------------------------------------------------------------------------------
# ZeRO-1 (hetero_llm/zero1.py): reduce-scatter of gradient blocks, all-gather of updated parameters.
# torch 2.13 renamed the *_tensor collectives *_single; both take (output, input) of equal chunks.
# Gloo copies a whole reduce-scatter's input and all-gather's output inside (50 MB in: +73 MB and +192 MB of
# peak memory, measured on CPU), which would cancel what ZeRO-1 saves; its reduce and broadcast work in place
# (+5 MB, +1 MB). So on gloo a reduce-scatter is one reduce per member (chunk j summed onto member j) and an
# all-gather one broadcast per member, about the same bytes sent per rank; NCCL runs the collectives themselves.

_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@attrs.frozen
class _Works:
    """Several started collectives, waited for as one."""

    works: tuple

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def start_reduce_scatter(comms: Comms, flat: torch.Tensor, group_name: str,
                         streams: Streams = NO_STREAMS) -> PendingReduce:
    """Start summing ``flat`` (one equal chunk per group member, in group rank order) among the group;
    ``wait()`` gives this rank's summed chunk (on gloo: a view into ``flat``). On CUDA it runs on the grads
    stream, after the backward."""
    group = comms.groups[group_name]
    members = dist.get_process_group_ranks(group)
    n = flat.numel() // len(members)
    streams.wait(streams.grads, streams.compute)
    with streams.use(streams.grads):
        if dist.get_backend(group) == "gloo":
            pieces = flat.view(len(members), n)
            work = _Works(tuple(dist.reduce(pieces[j], dst=r, group=group, async_op=True)
                                for j, r in enumerate(members)))
            out = pieces[members.index(comms.rank)]
        else:
            out = flat.new_empty(n)
            work = _reduce_scatter(out, flat, group=group, async_op=True)
    streams.hand_over(flat, streams.grads)
    return PendingReduce(work, out, [out.shape], streams)


def start_all_gather(comms: Comms, chunk: torch.Tensor, group_name: str,
                     streams: Streams = NO_STREAMS) -> PendingReduce:
    """Start gathering every member's ``chunk`` (equal sizes) into one flat tensor, in group rank order;
    ``wait()`` gives it."""
    group = comms.groups[group_name]
    members = dist.get_process_group_ranks(group)
    streams.wait(streams.grads, streams.compute)
    with streams.use(streams.grads):
        out = chunk.new_empty(chunk.numel() * len(members))
        if dist.get_backend(group) == "gloo":
            pieces = out.view(len(members), chunk.numel())
            pieces[members.index(comms.rank)].copy_(chunk)
            work = _Works(tuple(dist.broadcast(pieces[j], src=r, group=group, async_op=True)
                                for j, r in enumerate(members)))
        else:
            work = _all_gather(out, chunk, group=group, async_op=True)
    streams.hand_over(chunk, streams.grads)
    return PendingReduce(work, out, [out.shape], streams)


# ------------------------------------------------------------------------------------------
# Hot switching: another layout's groups over the same processes, and the batched switch exchange.


def layout_groups(plan: Plan, plan_rank: int | None, world_rank_of: dict[int, int]) -> dict[str, dist.ProcessGroup]:
    """Every group of another layout's ``plan`` (a hot-switching bucket) over this job's processes: created on
    every rank in plan order, members mapped to world ranks; ``plan_rank`` is this process's rank in
    ``plan`` (None: it has none), whose network settings apply as in ``init``."""
    timeout = timedelta(seconds=max(plan.layout.cluster.timeout_s, 30))
    groups = {}
    for g in plan.groups:
        env = group_env(plan, plan_rank, g) if plan_rank is not None and plan_rank in g.ranks else {}
        with environment(env):
            groups[g.name] = dist.new_group([world_rank_of[r] for r in g.ranks], timeout=timeout)
    dist.barrier()
    return groups


SWITCH_TAG = 1 << 20  # apart from every stage-boundary tag (_tag)


def exchange(sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]) -> None:
    """One flat message to and from each peer (global ranks): post every receive, then every send, then
    wait for all. Both sides list the same pairs (a switch plan every rank computes alike)."""
    works = [dist.irecv(buf, peer, tag=SWITCH_TAG) for peer, buf in sorted(receives.items())]
    works += [dist.isend(buf, peer, tag=SWITCH_TAG) for peer, buf in sorted(sends.items())]
    for w in works:
        w.wait()
