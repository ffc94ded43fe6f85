"""Every communicator of a rank, created eagerly on every rank in the same order, under its transport.

``init`` runs the rendezvous (``hetero_llm.comm.rendezvous``), the default group, then every plan group in
plan order, each under its transport's network settings (a domain's interface and NCCL variables,
``RankPlan.network``), and, for ``cluster.comm = 'cupy'``, CuPy NCCL communicators for gradient sync.
The result is a ``Comms`` record passed to whoever needs it: nothing here keeps module globals.
Written device-agnostic: gloo on CPU, NCCL on CUDA, same calls. What travels over these groups:
``hetero_llm.comm.p2p`` (stage boundaries) and ``hetero_llm.comm.collectives`` (TP, gradient sync, ZeRO-1).

Liveness is the heartbeats' business (``hetero_llm.comm.heartbeat``), not a wait's length: a rank may wait on
its peers for as long as they compute (a pipeline with a small share of the batch waits in the gradient sync,
a device idle for a hot-switching bucket waits out the whole bucket), so once the groups exist every wait on
a peer (a collective, a gloo send or receive, a shared-memory ring) lasts up to ``PEER_WAIT``. A stopped or
hung rank is named by its peers' heartbeats within ``cluster.timeout_s``; a dead one closes its connections
and rings, which fails the ranks waiting on it at once. Creating the groups, before any heartbeat runs, stays
bounded by ``cluster.timeout_s`` (30 s at least).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist

from hetero_llm.comm import shm
from hetero_llm.comm.rendezvous import rendezvous
from hetero_llm.errors import RankFailure
from hetero_llm.layout import CommLib
from hetero_llm.plan.rank import GradSyncKey, Group, GroupKey, RankPlan

PEER_WAIT = timedelta(days=7)  # see the module doc: far longer than any step; the heartbeats decide liveness


@attrs.define
class Comms:
    rank: int
    device: torch.device
    groups: dict[GroupKey, dist.ProcessGroup]  # by the plan's group key
    tp_group: dist.ProcessGroup | None  # this rank's TP group (None when TP size is 1)
    tp_ranks: tuple[int, ...]  # global ranks of this rank's TP group, TP index order
    pending_sends: list = attrs.field(factory=list)
    cupy: dict = attrs.field(factory=dict)  # group key -> CupyGroup, for cluster.comm = 'cupy'
    shm: dict = attrs.field(factory=dict)  # (src, dst, Direction) -> this rank's end of a shared-memory ring


def init(rp: RankPlan, device: torch.device, rings: shm.RankRings, agree: str = "") -> Comms:
    """Rendezvous, the default group, then every plan group in plan order (on every rank), then this rank's
    shared-memory ``rings``.

    Each group is created under its transport's network settings (``RankPlan.network``: its domain's,
    or the cross-domain network's when it spans domains), which are restored right after: gloo binds
    the group's sockets to GLOO_SOCKET_IFNAME when the group is constructed, NCCL reads its variables
    when the communicator is created, which we force at once with a one-element all-reduce.
    """
    store = rendezvous(rp, agree)  # hetero_llm.comm.rendezvous: where the store is, who serves it
    backend = rp.network.backend.value
    timeout = timedelta(seconds=max(rp.network.timeout_s, 30))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with _network_env(rp, rp.world):
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg", store),
            rank=rp.rank,
            world_size=rp.world_size,
            timeout=timeout,
            pg_options=_pg_options(rp, rp.world),
        )
        _connect(None, device, backend)
    groups: dict[GroupKey, dist.ProcessGroup] = {}
    for g in rp.groups:
        with _network_env(rp, g):
            groups[g.key] = dist.new_group(list(g.ranks), timeout=timeout, pg_options=_pg_options(rp, g))
            if rp.rank in g.ranks:
                _connect(groups[g.key], device, backend)
    cupy_groups = _cupy_groups(rp, store, device) if rp.network.comm is CommLib.CUPY else {}
    links = shm.connect(rings, store, timeout.total_seconds())  # boundaries inside a node (their groups stay: fallback)
    _warn_missing_interfaces(rp)
    tp_group = groups[rp.tp_group] if rp.tp_group is not None else None
    # Force the lazily-connecting backends to connect now, in plan order, on every rank.
    dist.barrier()
    _wait_for_peers(list(groups.values()), list(links.values()))
    return Comms(rp.rank, device, groups, tp_group, rp.stage.tp_ranks(rp.cp_index), cupy=cupy_groups, shm=links)


def _wait_for_peers(groups: list, links: list) -> None:
    """From now on the default group's, ``groups``' and the shared-memory ``links``' waits last up to
    ``PEER_WAIT`` (module doc). A gloo send or receive waits its context's timeout, fixed when its group was
    made: ``p2p`` waits for those with ``PEER_WAIT`` itself."""
    # torch's private setter (in torch 2.13, the tested version): without it, collectives keep the timeout the
    # groups were made with (a slow peer then ends the job after it), and p2p waits with PEER_WAIT regardless
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    for group in (None, *groups):
        if set_timeout is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:  # not in it: no waits
            set_timeout(PEER_WAIT, group)
    for link in links:
        link.timeout_s = PEER_WAIT.total_seconds()


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


def group_env(rp: RankPlan, group: Group) -> dict[str, str]:
    """The environment ``rp``'s rank creates ``group`` under (``RankPlan.network``; nothing for a group it is not
    in), minus a gloo interface this host lacks (plain CPU runs: the default applies)."""
    env = rp.network.env(group.key)
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


def gloo_world_group(rp: RankPlan, timeout: timedelta):
    """A gloo group of every rank beside the plan's (the snapshots' replicas travel over one), its sockets on the
    world's interface (``gloo_ifname``: without it gloo takes the hostname's address, which on a host whose name
    resolves to 127.0.0.1 reaches no other host)."""
    with _network_env(rp, rp.world):
        return dist.new_group(list(range(rp.world_size)), timeout=timeout, backend="gloo")


def _network_env(rp: RankPlan, group: Group):
    """The group's network variables, set while it is created (nothing for a rank outside it)."""
    return environment(group_env(rp, group) if rp.rank in group.ranks else {})


def _pg_options(rp: RankPlan, group: Group):
    """NCCL: per-communicator options carrying the transport's net (``config.net_name``, where this
    torch and NCCL have it; the NCCL_NET variable set around creation covers older ones). Gloo: None,
    since torch's new_group ignores gloo options (it builds the device from GLOO_SOCKET_IFNAME)."""
    if rp.network.backend.value != "nccl" or rp.rank not in group.ranks:
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    net = rp.network.env(group.key).get("NCCL_NET")
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


def _warn_missing_interfaces(rp: RankPlan) -> None:
    """One line per node (from its first rank, which holds the list) naming the layout's gloo interfaces this host
    lacks."""
    missing = [f"{name} ({', '.join(t)})" for name, t in rp.network.node_interfaces if not has_interface(name)]
    if missing:
        sys.stderr.write(
            f"warning: {rp.info.node}: no network interface {', '.join(missing)} on this host; those groups "
            "use the default interface (expected on a plain CPU run; on a cluster, check gloo_ifname)\n"
        )
        sys.stderr.flush()


# ------------------------------------------------------------------------------------------
# CuPy NCCL communicators for gradient sync (cluster.comm = 'cupy'): our own NCCL comms, one per
# gradient-sync group, created with the group's domain settings, run on torch's current stream.


@attrs.frozen
class CupyGroup:
    comm: Any  # cupy.cuda.nccl.NcclCommunicator (CuPy is optional and has no type stubs)
    ranks: tuple[int, ...]

    def all_reduce(self, flat: torch.Tensor) -> None:
        """In-place sum of a contiguous CUDA tensor, by its data pointer, on torch's current stream."""
        from cupy.cuda import nccl

        kinds = {torch.float32: nccl.NCCL_FLOAT32, torch.float64: nccl.NCCL_FLOAT64, torch.float16: nccl.NCCL_FLOAT16}
        if hasattr(nccl, "NCCL_BFLOAT16"):
            kinds[torch.bfloat16] = nccl.NCCL_BFLOAT16
        if flat.dtype not in kinds or not flat.is_cuda or not flat.is_contiguous():
            raise RankFailure(
                f"CuPy all-reduce needs a contiguous CUDA tensor of {sorted(map(str, kinds))}, "
                f"got {flat.dtype} on {flat.device}"
            )
        stream = torch.cuda.current_stream(flat.device).cuda_stream
        self.comm.allReduce(flat.data_ptr(), flat.data_ptr(), flat.numel(), kinds[flat.dtype], nccl.NCCL_SUM, stream)


def _cupy():
    try:
        import cupy
        from cupy.cuda import nccl  # noqa: F401  (CuPy built without NCCL fails here)
    except ImportError as e:
        raise RankFailure(
            f"cluster.comm = 'cupy' but CuPy with NCCL is not importable here ({e}) "
            "(pip install 'hetero_llm[cupy]', or set comm = 'torch')"
        ) from None
    return cupy


def _uid_to_json(uid) -> dict:
    """CuPy 13 gives NCCL's unique id as a tuple of ints, CuPy 14 as bytes; each takes back what it gives."""
    return {"hex": uid.hex()} if isinstance(uid, bytes) else {"ints": list(uid)}


def _uid_from_json(data: dict):
    return bytes.fromhex(data["hex"]) if "hex" in data else tuple(data["ints"])


def make_cupy_group(store: dist.Store, name: str, ranks: tuple[int, ...], rank: int, env: dict[str, str]) -> CupyGroup:
    """One NCCL communicator among ``ranks``: the first member makes the unique id, the store carries it."""
    nccl = _cupy().cuda.nccl
    key = f"cupy_nccl/{name}"
    me = ranks.index(rank)
    if me == 0:
        store.set(key, json.dumps(_uid_to_json(nccl.get_unique_id())))
    uid = _uid_from_json(json.loads(store.get(key)))  # get() waits until the key is there
    with environment(env):
        comm = nccl.NcclCommunicator(len(ranks), uid, me)  # blocking: NCCL reads its variables here
    return CupyGroup(comm, ranks)


def _cupy_groups(rp: RankPlan, store: dist.Store, device: torch.device) -> dict[GroupKey, CupyGroup]:
    """Every gradient-sync group this rank is in, in plan order (each init waits for all its members)."""
    out: dict[GroupKey, CupyGroup] = {}
    with _cupy().cuda.Device(device.index if device.index is not None else 0):
        for g in rp.groups:
            if isinstance(g.key, GradSyncKey) and rp.rank in g.ranks:
                out[g.key] = make_cupy_group(store, g.name, g.ranks, rp.rank, group_env(rp, g))
    return out


# ------------------------------------------------------------------------------------------
# Hot switching: another layout's groups over the same processes (the exchange itself: hetero_llm.comm.p2p).


def layout_groups(
    groups_in_order: tuple[Group, ...], rp: RankPlan | None, world_rank_of: dict[int, int]
) -> dict[GroupKey, dist.ProcessGroup]:
    """Every group of another layout (a hot-switching bucket) over this job's processes: created on every rank
    in that layout's order, members mapped to world ranks; ``rp`` is this process's RankPlan in that layout
    (None: it has none), whose network settings apply as in ``init`` (NCCL: its options, and its communicator
    made at once by its members, in the same order on every rank). Made while training, when the heartbeats
    run: their waits, creation included, last up to ``PEER_WAIT`` (a device idle for the bucket waits it out)."""
    groups = {}
    backend = dist.get_backend()
    for g in groups_in_order:
        member = rp is not None and rp.rank in g.ranks
        env = group_env(rp, g) if rp is not None and member else {}
        with environment(env):
            options = _pg_options(rp, g) if rp is not None else None
            groups[g.key] = dist.new_group([world_rank_of[r] for r in g.ranks], timeout=PEER_WAIT, pg_options=options)
            if member:
                _connect(groups[g.key], _current_device(backend), backend)
    dist.barrier()
    return groups


def switch_group(rp: RankPlan, device: torch.device) -> dist.ProcessGroup:
    """The group every hot switch's exchange runs in (``p2p.exchange``): all of the job's ranks, created by the
    ``Switcher`` on every rank at the same point (after the buckets' groups, before the first step), under the
    world's network settings, and connected at once.

    Its own group, because of how NCCL runs a batched point-to-point (``dist.batch_isend_irecv``): on the group's
    communicator, which NCCL builds at the group's first operation and which every member must then join (a
    lone ``isend``/``irecv`` instead builds a 2-rank communicator per pair, lazily, at the pair's first message:
    ranks that reach their pairs in different orders hang). With the communicator made here, by every rank in
    the same order, a switch's batch may involve any subset of the ranks (torch's ``batch_isend_irecv`` contract),
    and no switch creates anything. Gloo has no communicators to build: the same calls, plain sends and receives.
    """
    backend = rp.network.backend.value
    with _network_env(rp, rp.world):
        group = dist.new_group(list(range(rp.world_size)), timeout=PEER_WAIT, pg_options=_pg_options(rp, rp.world))
        _connect(group, device, backend)
    return group


def _current_device(backend: str) -> torch.device:
    """The device a group's first operation runs on: NCCL's is the rank's GPU (``init`` made it current)."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
