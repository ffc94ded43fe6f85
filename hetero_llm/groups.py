"""Every communicator of a rank, created eagerly on every rank in the same order, under its transport.

``init`` runs the rendezvous (``hetero_llm.rendezvous``), the default group, then every plan group in
plan order, each under its transport's network settings (a domain's interface and NCCL variables,
``Plan.group_env``), and, for ``cluster.comm = 'cupy'``, CuPy NCCL communicators for gradient sync.
The result is a ``Comms`` record passed to whoever needs it: nothing here keeps module globals.
Written device-agnostic: gloo on CPU, NCCL on CUDA, same calls. What travels over these groups:
``hetero_llm.p2p`` (stage boundaries) and ``hetero_llm.collectives`` (TP, gradient sync, ZeRO-1).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from datetime import timedelta

import attrs
import torch
import torch.distributed as dist

from hetero_llm import shm
from hetero_llm.errors import RankFailure
from hetero_llm.layout import CommLib
from hetero_llm.plan import Group, Plan
from hetero_llm.rendezvous import rendezvous


@attrs.define
class Comms:
    rank: int
    device: torch.device
    groups: dict[str, dist.ProcessGroup]  # by plan group name
    tp_group: dist.ProcessGroup | None  # this rank's TP group (None when TP size is 1)
    tp_ranks: tuple[int, ...]  # global ranks of this rank's TP group, TP index order
    pending_sends: list = attrs.field(factory=list)
    cupy: dict = attrs.field(factory=dict)  # group name -> CupyGroup, for cluster.comm = 'cupy'
    shm: dict = attrs.field(factory=dict)  # (src, dst, Direction) -> this rank's end of a shared-memory ring


def init(plan: Plan, rank: int, device: torch.device, agree: str = "") -> Comms:
    """Rendezvous, the default group, then every plan group in plan order (on every rank).

    Each group is created under its transport's network settings (``Plan.group_env``: its domain's,
    or the cross-domain network's when it spans domains), which are restored right after: gloo binds
    the group's sockets to GLOO_SOCKET_IFNAME when the group is constructed, NCCL reads its variables
    when the communicator is created, which we force at once with a one-element all-reduce.
    """
    store = rendezvous(plan.rank_plan(rank), agree)  # hetero_llm.rendezvous: where the store is, who serves it
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
    return Comms(rank, device, groups, tp_group, st.ranks, cupy=cupy_groups, shm=rings)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------
# Transports: each group's network settings (its domain's interface and NCCL variables), set while it is made.


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


# ------------------------------------------------------------------------------------------
# Hot switching: another layout's groups over the same processes (the exchange itself: hetero_llm.p2p).


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

