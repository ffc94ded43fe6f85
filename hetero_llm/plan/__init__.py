"""Compile a layout into what every rank does: pure data, no torch.

Rank numbering: pipelines in order, their stages in order, each stage's devices in order.
Every communicator is listed once in ``Plan.groups`` in one deterministic order, and every rank
creates all of them in that order (lazily created groups deadlock): the TP group of every stage, two
point-to-point groups per stage boundary (one per direction of data), and one group per gradient-sync
bucket. Each gets its members' network domain as transport (Holmes): a boundary inside a domain uses
that domain's fabric, only a boundary between domains the cross-domain network.

Gradient sync across pipelines that shard a parameter differently (HexiScale, generalized): the
shards of one parameter are cut at every shard boundary of every holder (the common refinement),
and each resulting block is summed among exactly the ranks holding it. Blocks with the same holder
set share one bucket, i.e. one all-reduce. These pieces, which follow from the stages (layer ranges,
boundaries and their routes, sync blocks, transports), are computed in ``blocks``; each pipeline's action
lists in ``schedules``.

Each rank's share of the plan is resolved here too, into one frozen ``RankPlan`` per rank
(``hetero_llm.plan.rank``): what the runtime side runs from. Group keys are made here and only here.
"""

from __future__ import annotations

import functools
import hashlib
import os

import attrs

from hetero_llm import schedule as sched
from hetero_llm.layout import SHM, Compile, Layout, Optimizer, Recompute, Schedule, bucket_layout, elastic_layout
from hetero_llm.model import cp_chunks
from hetero_llm.model.params import ParamInfo, shard_range
from hetero_llm.plan import blocks, rings, zero1_slices

# The plan's pieces live in plan/rank.py (a RankPlan holds them too); they are imported from here as well.
from hetero_llm.plan.rank import (
    WORLD,
    BatchShare,
    ComputeSettings,
    ContextPlan,
    CPKey,
    GradSyncKey,
    Group,
    GroupKey,
    Meeting,
    Network,
    OptimizerSlices,
    P2PKey,
    RankInfo,
    RankPlan,
    Route,
    Shard,
    StagePlan,
    StageRoutes,
    SyncBlocks,
    TPKey,
    chunk_params,
)
from hetero_llm.plan.schedules import pipeline_schedule
from hetero_llm.schedule import Direction, Kind


@attrs.frozen
class Plan:
    layout: Layout
    ranks: tuple[RankInfo, ...]
    stages: tuple[StagePlan, ...]
    groups: tuple[Group, ...]  # creation order
    sync_blocks: tuple[SyncBlocks, ...]
    schedules: tuple[tuple[tuple[sched.Action, ...], ...], ...]  # [pipeline][stage] -> actions
    routes_f: tuple[Route, ...]
    routes_b: tuple[Route, ...]
    rank_plans: tuple[RankPlan, ...] = ()  # what each rank does (``RankPlan``), by rank
    # Hot switching: every bucket's own plan (``layout.bucket_layout``), shortest bucket first, compiled with this
    # one so that no rank, dry run or prediction compiles them again
    buckets: tuple[Plan, ...] = ()
    shm_links: tuple[rings.ShmLink, ...] = ()  # the boundary pieces that travel through shared-memory rings
    # The width of the rows this plan runs (0: ``model.seq_len``): a bucket's plan is compiled for rows of its
    # ``max_len``, which its context-parallel chunks and re-chunking boundaries cut (``row_width``)
    width: int = 0
    # Indexes built once from the fields above (``stage_of``, ``batch_share`` are asked per rank: a scan each
    # time made a 1,024-rank dry run quadratic)
    _stage_at: dict[tuple[int, int], StagePlan] = attrs.field(init=False, repr=False, eq=False)
    _batch_offsets: tuple[int, ...] = attrs.field(init=False, repr=False, eq=False)
    _by_rounds: dict[int, Plan] = attrs.field(init=False, factory=dict, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        stage_at: dict[tuple[int, int], StagePlan] = {}
        for s in self.stages:
            stage_at.setdefault((s.pipeline, s.stage), s)
        offsets = [0]
        for p in self.layout.pipelines:
            offsets.append(offsets[-1] + p.batch)
        object.__setattr__(self, "_stage_at", stage_at)  # frozen: set once, here
        object.__setattr__(self, "_batch_offsets", tuple(offsets))

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def row_width(self) -> int:
        """The positions of every row this plan runs: ``model.seq_len``, or a bucket's ``max_len``."""
        return self.width or self.layout.model.seq_len

    def stage_of(self, rank: int) -> StagePlan:
        r = self.ranks[rank]
        return self._stage_at[(r.pipeline, r.stage)]

    def actions(self, rank: int) -> tuple[sched.Action, ...]:
        r = self.ranks[rank]
        return self.schedules[r.pipeline][r.stage]

    def params_of(self, rank: int) -> list[tuple[ParamInfo, int, int]]:
        """(info, lo, hi) of every parameter shard ``rank`` holds, along info.shard_dim (or dim 0)."""
        st = self.stage_of(rank)
        return list(_held(self.layout.model, st, self.ranks[rank].tp_index))

    def batch_share(self, pipeline: int) -> tuple[int, int]:
        """(offset, size) of a pipeline's contiguous rows of the global batch."""
        return self._batch_offsets[pipeline], self.layout.pipelines[pipeline].batch

    def for_rounds(self, rounds: int) -> Plan:
        """An elastic bucket's plan for a step whose rows need ``rounds`` times its pipelines' batch shares
        (``layout.elastic_layout``): how many is known only from the step's documents, so each count is compiled
        on its first use and kept (every rank draws the same documents, so every rank compiles the same plans)."""
        if rounds not in self._by_rounds:
            lay = elastic_layout(self.layout, rounds)
            self._by_rounds[rounds] = self if lay is self.layout else compile_plan(lay, self.width)
        return self._by_rounds[rounds]

    def fingerprint(self) -> str:
        """A short hash of what every rank must agree on (the layout's content, not its file path)."""
        lay = self.layout

        def local(pipes):  # schedule files by name: every node has its own path to them
            return tuple(attrs.evolve(p, schedule_file=os.path.basename(p.schedule_file)) for p in pipes)

        base = os.path.basename  # paths are resolved per host: compare file names
        data = attrs.evolve(
            lay.data, path=base(lay.data.path), valid_path=base(lay.data.valid_path), tokenizer=base(lay.data.tokenizer)
        )
        content = attrs.evolve(
            lay,
            file="",
            data=data,
            model=attrs.evolve(lay.model, init_from=base(lay.model.init_from)),
            pipelines=local(lay.pipelines),
            buckets=tuple(attrs.evolve(b, pipelines=local(b.pipelines)) for b in lay.buckets),
        )
        return hashlib.sha256(repr(content).encode()).hexdigest()[:12]

    def tp_group(self, stage: StagePlan, cp_index: int = 0) -> TPKey | None:
        """The key of ``stage``'s TP group (of its CP rank ``cp_index``; None: TP size 1, no group)."""
        return _tp_key(stage, cp_index) if stage.tp > 1 else None

    def context(self, rank: int) -> ContextPlan | None:
        """``rank``'s context-parallel facts: its CP group, index, ring peers and chunks (None: its stage has cp 1)."""
        st, info = self.stage_of(rank), self.ranks[rank]
        if st.cp == 1:
            return None
        lo, hi = cp_chunks.chunk_ranges(self.row_width, st.cp, info.cp_index)
        return ContextPlan(
            _cp_key(st, info.tp_index), info.cp_index, st.cp_ranks(info.tp_index), (lo, hi), st.cp_overlap
        )

    @property
    def meeting(self) -> Meeting:
        """Where the ranks meet (``rendezvous.endpoint``)."""
        cluster = self.layout.cluster
        master = cluster.master_node
        server = next((r.rank for r in self.ranks if r.node == master.name), None)
        return Meeting(
            master.host, cluster.port, master.name, bool(cluster.master), server, cluster.timeout_s, self.layout.file
        )

    def rank_plan(self, rank: int) -> RankPlan:
        """What ``rank`` does: its share of this plan, with no way back to the layout."""
        return self.rank_plans[rank]

    @property
    def world(self) -> Group:
        """The default group: every rank; it carries the rendezvous barrier and the logged-loss reduction."""
        ranks = tuple(r.rank for r in self.ranks)
        return Group(WORLD, ranks, blocks.transport_of(self.layout, [r.node for r in self.ranks]))

    def route_group(self, direction: Direction, route: Route) -> P2PKey:
        """The group a boundary piece travels in (FWD: an activation, BWD: its gradient)."""
        return _p2p_key(direction, self.stage_of(route.src), self.stage_of(route.dst))

    def group_env(self, rank: int, group: Group) -> dict[str, str]:
        """Environment ``rank`` creates ``group`` under: GLOO_SOCKET_IFNAME and NCCL variables.

        NCCL initializes each of its nets (IB, Socket) once per process and keeps the device list it
        found then, so the rank's own domain's variables are the base of every group it creates and the
        group's transport overrides them: the first group (the world, often cross-domain) then also
        initializes IB with this domain's NCCL_IB_HCA. NCCL_NET is read per communicator.
        """
        cluster = self.layout.cluster
        own = cluster.transport(cluster.domain_of(self.ranks[rank].node))
        spec = own if group.transport == SHM else cluster.transport(group.transport)
        env = dict(own.nccl_env) if own is not None else {}
        if spec is not None:
            env.update(spec.nccl_env)
            if spec.gloo_ifname:
                env["GLOO_SOCKET_IFNAME"] = spec.gloo_ifname
        return env


def _held(model, st: StagePlan, tp_index: int) -> tuple[tuple[ParamInfo, int, int], ...]:
    """``Plan.params_of``: the same for every rank at one place of one stage shape, so made once for each."""
    return _held_at(model, tuple(st.chunk_shape(c) for c in range(len(st.chunk_ranges))), st.tp, tp_index)


@functools.lru_cache(maxsize=1024)
def _held_at(model, chunks: tuple, tp: int, tp_index: int) -> tuple[tuple[ParamInfo, int, int], ...]:
    return tuple((p, *shard_range(p, tp, tp_index)) for p in chunk_params(model, chunks))


def compile_plan(layout: Layout, width: int = 0) -> Plan:
    """Every rank's share of ``layout``, and each bucket's plan (compiled for rows of its ``max_len``). ``width``:
    the positions of the rows the plan runs (0: ``model.seq_len``; a bucket's plan: its ``max_len``)."""
    width = 0 if width == layout.model.seq_len else width
    ranks: list[RankInfo] = []
    stages: list[StagePlan] = []
    schedules = []
    nodes = {n.name: n for n in layout.cluster.nodes}
    chunks = layout.train.chunks
    shared: dict[tuple, tuple] = {}
    for pi, pipe in enumerate(layout.pipelines):
        n = len(pipe.stages)
        ranges = blocks.chunk_ranges([st.layers for st in pipe.stages], chunks)
        for si, st in enumerate(pipe.stages):
            stage_ranks: list[int] = []
            for di, dev in enumerate(st.devices):  # CP-major: device di is TP index di % tp of CP rank di // tp
                node, _, idx = dev.partition(":")
                rank = len(ranks)
                ranks.append(RankInfo(rank, pi, si, di % st.tp, node, dev, nodes[node].devices[int(idx)], di // st.tp))
                stage_ranks.append(rank)
            stages.append(StagePlan(pi, si, tuple(stage_ranks), ranges[si], n, st.cp, st.cp_overlap))
        actions = pipeline_schedule(layout, pi)
        if layout.train.optimizer is Optimizer.ADAMW_ZERO1:
            actions = sched.add_optimizer_actions(actions)  # AG before each stage's first F, RS after its last B
        lists = tuple(tuple(a) for a in actions)
        schedules.append(shared.setdefault(lists, lists))  # pipelines of one shape hold the same tuples

    pairs = blocks.boundary_pairs(stages, wrap=chunks > 1)
    routes_f, routes_b = blocks.boundary_routes(pairs, width or layout.model.seq_len)
    sync_blocks = blocks.sync_blocks(layout, stages)
    node_of = [r.node for r in ranks]

    def group(key: GroupKey, members: tuple[int, ...]) -> Group:
        return Group(key, members, blocks.transport_of(layout, [node_of[r] for r in members]))

    # Every group key is made here (and in ``_p2p_key``): the runtime looks groups up by these keys.
    groups = [group(_tp_key(s, c), s.tp_ranks(c)) for s in stages if s.tp > 1 for c in range(s.cp)]
    groups += [group(_cp_key(s, t), s.cp_ranks(t)) for s in stages if s.cp > 1 for t in range(s.tp)]
    for a, b in pairs:
        members = tuple(sorted(a.ranks + b.ranks))
        via = blocks.p2p_transport(layout, [ranks[r] for r in members])
        groups += [
            Group(_p2p_key(Direction.FWD, a, b), members, via),
            Group(_p2p_key(Direction.BWD, b, a), members, via),
        ]
    groups += [group(GradSyncKey(b.group), b.group) for b in sync_blocks]
    plan = Plan(
        layout,
        tuple(ranks),
        tuple(stages),
        tuple(groups),
        tuple(sync_blocks),
        tuple(schedules),
        tuple(routes_f),
        tuple(routes_b),
        width=width,
    )
    buckets = tuple(compile_plan(bucket_layout(layout, i), b.max_len) for i, b in enumerate(layout.buckets))
    return attrs.evolve(plan, rank_plans=rank_plans(plan), buckets=buckets, shm_links=_shm_links(plan))


def _shm_links(plan: Plan) -> tuple[rings.ShmLink, ...]:
    routes = ((Direction.FWD, plan.routes_f), (Direction.BWD, plan.routes_b))
    return rings.shm_links(plan.layout, plan.groups, routes, plan.stage_of, plan.route_group)


def _tp_key(st: StagePlan, cp_index: int = 0) -> TPKey:
    return TPKey(st.pipeline, st.stage, cp_index)


def _cp_key(st: StagePlan, tp_index: int) -> CPKey:
    return CPKey(st.pipeline, st.stage, tp_index)


def _p2p_key(direction: Direction, src: StagePlan, dst: StagePlan) -> P2PKey:
    """The group carrying ``direction`` (FWD: activations, BWD: their gradients) from ``src`` to ``dst``.

    One group per boundary and direction, not one per boundary: NCCL matches sends to receives by
    order on a communicator and runs them one after the other, so activations one way and gradients
    the other way on one communicator can wait for each other (1F1B sends a forward while the peer
    sends a gradient back); on separate communicators each stream keeps its own order.
    """
    return P2PKey(direction, (src.pipeline, src.stage), (dst.pipeline, dst.stage))


def rank_plans(plan: Plan) -> tuple[RankPlan, ...]:
    """Every rank's ``RankPlan``: its share of ``plan``, resolved now so that no rank re-derives it at run time."""
    lay = plan.layout
    tr = lay.train
    world = plan.world
    fingerprint, meeting = plan.fingerprint(), plan.meeting
    peers = tuple(r.device_id for r in plan.ranks)
    env_of = _group_envs(plan)
    interfaces = _node_interfaces(plan, env_of)
    stage_of = {(s.pipeline, s.stage): s for s in plan.stages}
    params = {s: s.params(lay.model) for s in plan.stages}
    member_of: dict[int, list[Group]] = {r.rank: [world] for r in plan.ranks}
    for g in plan.groups:
        for r in g.ranks:
            member_of[r].append(g)
    sync_blocks_of: dict[int, list[SyncBlocks]] = {r.rank: [] for r in plan.ranks}
    for b in plan.sync_blocks:
        for r in b.group:
            sync_blocks_of[r].append(b)
    first_on_node: dict[str, int] = {}
    for info in plan.ranks:
        first_on_node.setdefault(info.node, info.rank)
    sharded = tr.optimizer is Optimizer.ADAMW_ZERO1
    if sharded:
        units = zero1_slices.by_rank(zero1_slices.units(plan))
    routes_of = _routes_by_rank(plan)

    shards_of: dict[tuple, tuple[Shard, ...]] = {}  # the same for every rank at one place of one stage shape

    def shards(info: RankInfo) -> tuple[Shard, ...]:
        st = stage_of[(info.pipeline, info.stage)]
        key = (st.chunk_ranges, st.first, st.last, st.tp, info.tp_index)  # what its parameters and ranges follow from
        if key not in shards_of:
            shards_of[key] = tuple(
                Shard(p, *shard_range(p, st.tp, info.tp_index), st.tp if p.shard_dim is None else 1) for p in params[st]
            )
        return shards_of[key]

    split_backward: dict[int, bool] = {}  # by id of a stage's action tuple (shared by pipelines of one shape)
    shards_by_rank = tuple(shards(info) for info in plan.ranks)
    out = []
    for info in plan.ranks:
        rank = info.rank
        slices = None
        if sharded:
            mine, rest = zero1_slices.owned(plan, rank, in_units=units.get(rank, []))
            slices = OptimizerSlices(tuple((u, tuple(sl)) for u, sl in mine), tuple(rest))
        st = stage_of[(info.pipeline, info.stage)]
        pipe = lay.pipelines[st.pipeline]
        actions = plan.schedules[st.pipeline][st.stage]
        if id(actions) not in split_backward:
            split_backward[id(actions)] = any(a.kind is sched.Kind.I for a in actions)
        spec = pipe.stages[st.stage]
        recompute = spec.recompute if spec.recompute is not None else tr.recompute
        compute = ComputeSettings(tr.precision, recompute is Recompute.FULL, tr.compile is Compile.BLOCKS)
        offset, size = plan.batch_share(st.pipeline)
        envs = tuple((g.key, env_of(info, g)) for g in member_of[rank])
        network = Network(
            lay.cluster.backend,
            lay.cluster.comm,
            lay.cluster.timeout_s,
            envs,
            interfaces[info.node] if first_on_node[info.node] == rank else (),
        )
        out.append(
            RankPlan(
                rank=rank,
                world_size=plan.world_size,
                file=lay.file,
                info=info,
                stage=st,
                model=lay.model,
                train=tr,
                data=lay.data,
                actions=actions,
                dynamic=tr.schedule is Schedule.DYNAMIC and not pipe.schedule_file,
                split_backward=split_backward[id(actions)],
                sharded_optimizer=sharded,
                optimizer_slices=slices,
                compute=compute,
                shards=shards_by_rank[rank],
                sync_blocks=tuple(sync_blocks_of[rank]),
                routes=_stage_routes(plan, rank, routes_of),
                tp_group=plan.tp_group(st, info.cp_index),
                context=plan.context(rank),
                world=world,
                groups=plan.groups,
                network=network,
                batch=BatchShare(offset, size, pipe.microbatches),
                counts_loss=st.last and info.tp_index == 0,
                hot_switching=bool(lay.buckets),
                reports=rank == 0,
                fingerprint=fingerprint,
                meeting=meeting,
                peers=peers,
                saved_shards=shards_by_rank if rank == 0 else (),
            )
        )
    return tuple(out)


def _group_envs(plan: Plan):
    """``env_of(rank info, group)``: ``Plan.group_env`` as sorted pairs, computed once per (node, transport)."""
    cache: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {}

    def env_of(info: RankInfo, group: Group) -> tuple[tuple[str, str], ...]:
        key = (info.node, group.transport)
        if key not in cache:
            cache[key] = tuple(sorted(plan.group_env(info.rank, group).items()))
        return cache[key]

    return env_of


def _routes_by_rank(plan: Plan) -> dict[tuple[int, str], list[Route]]:
    """Every route under (rank, side): (its dst, 'recv_f' | 'recv_b') and (its src, 'send_f' | 'send_b'), in plan order."""
    out: dict[tuple[int, str], list[Route]] = {}
    for routes, f_or_b in ((plan.routes_f, "f"), (plan.routes_b, "b")):
        for r in routes:
            out.setdefault((r.dst, "recv_" + f_or_b), []).append(r)
            out.setdefault((r.src, "send_" + f_or_b), []).append(r)
    return out


def _stage_routes(plan: Plan, rank: int, routes_of: dict[tuple[int, str], list[Route]]) -> StageRoutes:
    """``rank``'s pieces of its stage boundaries and the groups they travel in (``routes_of``: ``_routes_by_rank``)."""
    into = {side: routes_of.get((rank, side), []) for side in ("recv_f", "recv_b")}

    def received(side: str) -> Route | None:
        return next((r for r in into[side] if not r.runs), None)

    def runs(side: str) -> tuple[Route, ...]:  # a boundary that re-chunks: one per sender
        return tuple(r for r in into[side] if r.runs)

    recv_f, recv_b = received("recv_f"), received("recv_b")
    runs_f, runs_b = runs("recv_f"), runs("recv_b")
    send_f = tuple(routes_of.get((rank, "send_f"), ()))
    send_b = tuple(routes_of.get((rank, "send_b"), ()))
    sides = (
        (Kind.RECV_F, recv_f or (runs_f[0] if runs_f else None)),
        (Kind.SEND_F, send_f[0] if send_f else None),
        (Kind.RECV_B, recv_b or (runs_b[0] if runs_b else None)),
        (Kind.SEND_B, send_b[0] if send_b else None),
    )
    groups = []
    for kind, route in sides:
        if route is not None:
            assert kind.direction is not None  # a send or a receive has one
            groups.append((kind, plan.route_group(kind.direction, route)))
    return StageRoutes(recv_f, send_f, recv_b, send_b, tuple(groups), runs_f, runs_b)


def _node_interfaces(plan: Plan, env_of) -> dict[str, tuple[tuple[str, tuple[str, ...]], ...]]:
    """Per node: the gloo interfaces its ranks create groups on, each with those groups' transports."""
    wanted: dict[str, dict[str, set[str]]] = {}
    for g in (plan.world,) + plan.groups:
        for r in g.ranks:
            info = plan.ranks[r]
            name = dict(env_of(info, g)).get("GLOO_SOCKET_IFNAME")
            if name:
                wanted.setdefault(info.node, {}).setdefault(name, set()).add(g.transport)
    return {
        n.name: tuple((name, tuple(sorted(t))) for name, t in sorted(wanted.get(n.name, {}).items()))
        for n in plan.layout.cluster.nodes
    }
