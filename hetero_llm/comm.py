"""Every communication call of the runtime: rendezvous, groups, TP collectives, stage p2p, grad sync.

Communicators are values built once from the pure plan, on every rank in the same order, named for
their job. Nothing here keeps module globals: a ``Comms`` record is passed to whoever needs it.
Written device-agnostic: gloo on CPU, NCCL on CUDA, same calls.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import attrs
import torch
import torch.distributed as dist

from hetero_llm.errors import RankFailure
from hetero_llm.model import TP
from hetero_llm.plan import Plan, Route


# ------------------------------------------------------------------------------------------
# Rendezvous: our own arrival check on the TCP store, so a rank that never comes is named.


def master_address(plan: Plan) -> tuple[str, int]:
    cluster = plan.layout.cluster
    addr = os.environ.get("MASTER_ADDR") or cluster.master_node.host
    port = int(os.environ.get("MASTER_PORT") or cluster.port)
    return addr, port


def rendezvous(plan: Plan, rank: int) -> dist.Store:
    addr, port = master_address(plan)
    world = plan.world_size
    timeout = plan.layout.cluster.timeout_s
    try:
        store = dist.TCPStore(addr, port, world, is_master=(rank == 0), timeout=timedelta(seconds=timeout),
                              wait_for_workers=False)
    except (RuntimeError, TimeoutError) as e:
        if rank == 0:
            raise RankFailure(f"rank 0 could not serve the rendezvous on {addr}:{port}: {e} "
                              f"(port in use? set MASTER_PORT or cluster.port)") from None
        raise RankFailure(f"rank {rank} could not reach the rendezvous at {addr}:{port} within {timeout:g} s "
                          f"(is rank 0 on {plan.ranks[0].device_id} started? {e})") from None
    store.set(f"arrived/{rank}", "1")
    if rank == 0:
        deadline = time.monotonic() + timeout
        missing = list(range(world))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"arrived/{r}"])]
            if missing:
                time.sleep(0.05)
        if missing:
            names = ", ".join(f"rank {r} ({plan.ranks[r].device_id})" for r in missing)
            store.set("go", "abort")
            raise RankFailure(f"rendezvous timed out after {timeout:g} s: never arrived: {names}")
        store.set("go", "ok")
    else:
        try:
            store.wait(["go"], timedelta(seconds=timeout))
            go = store.get("go")
        except Exception:  # a timeout, or rank 0 gave up and closed the store: both end the rendezvous
            raise RankFailure(f"rank {rank}: rendezvous did not complete within {timeout:g} s "
                              f"(rank 0 names the ranks that never arrived)") from None
        if go != b"ok":
            raise RankFailure(f"rank {rank}: rendezvous aborted by rank 0 (another rank never arrived)")
    return store


@attrs.define
class Comms:
    rank: int
    world_size: int
    device: torch.device
    groups: dict[str, dist.ProcessGroup]  # by plan group name
    tp_group: dist.ProcessGroup | None  # this rank's TP group (None when TP size is 1)
    tp_ranks: tuple[int, ...]  # global ranks of this rank's TP group, TP index order
    pending_sends: list = attrs.field(factory=list)


def init(plan: Plan, rank: int, device: torch.device) -> Comms:
    """Rendezvous, the default group, then every plan group in plan order (on every rank)."""
    store = rendezvous(plan, rank)
    backend = plan.layout.cluster.backend.value
    timeout = timedelta(seconds=max(plan.layout.cluster.timeout_s, 30))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=plan.world_size, timeout=timeout)
    groups: dict[str, dist.ProcessGroup] = {}
    for g in plan.groups:
        groups[g.name] = dist.new_group(list(g.ranks), timeout=timeout)
    st = plan.stage_of(rank)
    tp_group = groups.get(f"tp[{st.label}]")
    # Force the lazily-connecting backends to connect now, in plan order, on every rank.
    dist.barrier()
    return Comms(rank, plan.world_size, device, groups, tp_group, st.ranks)


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
# Stage-boundary p2p: a tensor crosses once, in pieces, and is all-gathered in the receiving group.


def _tag(direction: int, mb: int, chunk: int, piece: int) -> int:
    return ((mb * 16 + chunk) * 2 + direction) * 64 + piece


def _piece_len(numel: int, pieces: int) -> int:
    return -(-numel // pieces)


def send_boundary(comms: Comms, tensor: torch.Tensor, routes: list[Route], direction: int, mb: int, chunk: int) -> None:
    """Send this rank's pieces of ``tensor`` (non-blocking; completed by ``wait_sends``)."""
    flat = tensor.detach().contiguous().view(-1)
    for r in routes:
        n = _piece_len(flat.numel(), r.pieces)
        piece = flat[r.piece * n:(r.piece + 1) * n]
        if piece.numel() < n:
            piece = torch.cat([piece, piece.new_zeros(n - piece.numel())])
        piece = piece.contiguous()
        work = dist.isend(piece, r.dst, tag=_tag(direction, mb, chunk, r.piece))
        comms.pending_sends.append((work, piece))  # keep the buffer alive until sent


@attrs.define
class PendingRecv:
    work: object
    buffer: torch.Tensor
    route: Route
    shape: tuple[int, ...]
    _arrived: threading.Event | None = None
    _error: list = attrs.field(factory=list)

    def watch(self) -> None:
        """Make ``arrived()`` pollable. Gloo's p2p Work only completes inside ``wait()``, so a daemon
        thread waits for it; NCCL's ``is_completed()`` queries the CUDA event and needs no thread."""
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

        threading.Thread(target=waiter, daemon=True).start()

    def arrived(self) -> bool:
        if self._arrived is not None:
            return self._arrived.is_set()
        return self.work.is_completed()

    def wait(self, comms: Comms) -> torch.Tensor:
        if self._arrived is not None:
            self._arrived.wait()
            if self._error:
                raise self._error[0]
        else:
            self.work.wait()
        numel = 1
        for s in self.shape:
            numel *= s
        if self.route.pieces == 1:
            return self.buffer[:numel].view(self.shape)
        gathered = [torch.empty_like(self.buffer) for _ in range(self.route.pieces)]
        dist.all_gather(gathered, self.buffer, group=comms.tp_group)
        return torch.cat(gathered)[:numel].view(self.shape)


def recv_boundary(comms: Comms, route: Route, shape: tuple[int, ...], dtype: torch.dtype,
                  direction: int, mb: int, chunk: int) -> PendingRecv:
    numel = 1
    for s in shape:
        numel *= s
    buf = torch.empty(_piece_len(numel, route.pieces), dtype=dtype, device=comms.device)
    work = dist.irecv(buf, route.src, tag=_tag(direction, mb, chunk, route.piece))
    return PendingRecv(work, buf, route, shape)


def wait_sends(comms: Comms) -> None:
    for work, _ in comms.pending_sends:
        work.wait()
    comms.pending_sends.clear()


# ------------------------------------------------------------------------------------------
# Reductions


def all_reduce_flat(comms: Comms, tensors: list[torch.Tensor], group_name: str) -> list[torch.Tensor]:
    """Sum ``tensors`` among the group in one collective; returns the summed tensors."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=comms.groups[group_name])
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def all_reduce_world(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def barrier() -> None:
    dist.barrier()
