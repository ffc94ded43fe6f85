"""What one rank does: the frozen record ``compile_plan`` gives every rank. Pure data, no torch.

A ``Plan`` is the whole job (every rank, every group, the layout it came from); a ``RankPlan`` is one
rank's share of it, resolved once at compile time: its stage and model-chunk shapes, its action list
and how to run it (dynamic or not, split backward or not), its compute settings (the stage's recompute,
else the train's), its parameter shards, the sync block groups (gradient sync) it is in, its pieces of the stage
boundaries with the groups they travel in, every group it creates with the network settings it creates
them under, its rows of the global batch and whether its loss is the one its pipeline counts.
The runtime side (train, runtime, comm, checkpoint writing, trace) takes a ``RankPlan`` and holds no
``Layout``: it carries only the layout's model, train and data sections, which the model math, the
optimizer and the data sources read.

Groups are named by typed keys (``TPKey``, ``P2PKey``, ``GradSyncKey``, ``WORLD``), made in one place,
``plan.compile_plan``; a process group is looked up by its key, never by a name rebuilt from parts.
A key's ``name`` is what people read (``tp[p0.s1]``, ``p2p_fwd[p0.s0->p0.s1]``, ``grad_sync[0,3]``).
"""

from __future__ import annotations

import functools

import attrs

from hetero_llm import schedule as sched
from hetero_llm.layout import DEFAULT_TRANSPORT, Backend, CommLib, DataSpec, ModelSpec, Precision, TrainSpec
from hetero_llm.model.params import ParamInfo, stage_params
from hetero_llm.schedule import Direction, Kind

# ------------------------------------------------------------------------------------------
# Group keys


@attrs.frozen(order=True)
class WorldKey:
    """The default group: every rank (rendezvous barrier, the logged-loss reduction)."""

    @property
    def name(self) -> str:
        return "world"


WORLD = WorldKey()


@attrs.frozen(order=True)
class TPKey:
    """The tensor-parallel group of one stage (of one of its context-parallel ranks ``cp`` when it has cp > 1)."""

    pipeline: int
    stage: int
    cp: int = 0

    @property
    def name(self) -> str:
        return f"tp[p{self.pipeline}.s{self.stage}" + (f".c{self.cp}" if self.cp else "") + "]"


@attrs.frozen(order=True)
class CPKey:
    """The context-parallel group of one stage's TP index ``tp``: the ranks holding the sequence's chunks, whose
    keys and values go round in a ring (``comm/ring.py``)."""

    pipeline: int
    stage: int
    tp: int

    @property
    def name(self) -> str:
        return f"cp[p{self.pipeline}.s{self.stage}.t{self.tp}]"


@attrs.frozen(order=True)
class P2PKey:
    """The group carrying one direction of one stage boundary, from stage ``src`` to stage ``dst``
    (each a (pipeline, stage) pair). One group per boundary and direction (see ``plan.compile_plan``)."""

    direction: Direction
    src: tuple[int, int]
    dst: tuple[int, int]

    @property
    def name(self) -> str:
        (sp, ss), (dp, ds) = self.src, self.dst
        return f"p2p_{self.direction.label}[p{sp}.s{ss}->p{dp}.s{ds}]"


@attrs.frozen(order=True)
class GradSyncKey:
    """The group summing the gradient blocks held by exactly ``ranks``."""

    ranks: tuple[int, ...]

    @property
    def name(self) -> str:
        return "grad_sync[" + ",".join(map(str, self.ranks)) + "]"


GroupKey = WorldKey | TPKey | CPKey | P2PKey | GradSyncKey


# ------------------------------------------------------------------------------------------
# The plan's pieces (shared by ``Plan`` and ``RankPlan``)


@attrs.frozen
class StagePlan:
    pipeline: int
    stage: int
    ranks: tuple[int, ...]  # TP x CP, CP-major: rank cp_index * tp + tp_index (the TP group when cp is 1)
    chunk_ranges: tuple[tuple[int, int], ...]  # [lo, hi) layers of each model chunk on this stage
    num_stages: int  # stages of this pipeline
    cp: int = 1  # context-parallel size: the stage's TP groups, each holding its chunks of every sequence
    cp_overlap: bool = True  # the ring's transfers overlap the attention blocks (the layout's cp_overlap)

    @property
    def tp(self) -> int:
        return len(self.ranks) // self.cp

    def tp_ranks(self, cp_index: int) -> tuple[int, ...]:
        """The TP group of context-parallel rank ``cp_index``, in TP index order."""
        return self.ranks[cp_index * self.tp : (cp_index + 1) * self.tp]

    def cp_ranks(self, tp_index: int) -> tuple[int, ...]:
        """The context-parallel group of TP index ``tp_index``, in CP index order (the ring's order)."""
        return self.ranks[tp_index :: self.tp]

    @property
    def label(self) -> str:
        return f"p{self.pipeline}.s{self.stage}"

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def layer_lo(self) -> int:
        return self.chunk_ranges[0][0]

    @property
    def layer_hi(self) -> int:
        return self.chunk_ranges[-1][1]

    def chunk_shape(self, chunk: int) -> tuple[int, int, bool, bool]:
        """(layer_lo, layer_hi, holds the embedding, holds the head) of one model chunk."""
        lo, hi = self.chunk_ranges[chunk]
        last_chunk = len(self.chunk_ranges) - 1
        return lo, hi, self.first and chunk == 0, self.last and chunk == last_chunk

    def params(self, model: ModelSpec) -> list[ParamInfo]:
        return list(chunk_params(model, tuple(self.chunk_shape(c) for c in range(len(self.chunk_ranges)))))


@functools.lru_cache(maxsize=256)  # a plan asks once per rank for the few shapes its stages have
def chunk_params(model: ModelSpec, chunks: tuple[tuple[int, int, bool, bool], ...]) -> tuple[ParamInfo, ...]:
    """The parameters of a stage's model chunks, each once (a tied ``embed.tok`` on a first and last stage)."""
    out: list[ParamInfo] = []
    seen: set[str] = set()  # names are global: one name, one tensor
    for shape in chunks:
        for info in stage_params(model, *shape):
            if info.name not in seen:
                seen.add(info.name)
                out.append(info)
    return tuple(out)


@attrs.frozen
class RankInfo:
    rank: int
    pipeline: int
    stage: int
    tp_index: int
    node: str
    device_id: str  # "node0:1"
    device: str  # "cpu" or "cuda:1"
    cp_index: int = 0  # its context-parallel rank in the stage: which chunks of every sequence it holds


@attrs.frozen
class Route:
    """One piece of a stage-boundary tensor: piece ``piece`` of ``pieces`` goes ``src`` -> ``dst``.

    A boundary tensor is replicated on the sending TP group; it crosses the boundary once, split in
    as many pieces as the receiving group has ranks, each sent by a different sender where possible,
    and is re-assembled by an all-gather inside the (fast, intra-stage) receiving group.
    """

    src: int
    dst: int
    piece: int
    pieces: int
    # Re-chunking between stages of different cp: the sender's positions the receiver holds, as runs
    # (sender's local index, receiver's local index, length) along the sequence; sent whole, not in pieces
    # (piece 0 of 1), a receiver assembling its tensor from every sender it has a run from. () : the whole tensor.
    runs: tuple[tuple[int, int, int], ...] = ()


@attrs.frozen
class SyncBlocks:
    """Blocks of gradients that one all-reduce sums among ``group``.

    ``entries`` are (param name, dim, lo, hi) in the full tensor's coordinates.
    """

    group: tuple[int, ...]
    entries: tuple[tuple[str, int, int, int], ...]

    @property
    def key(self) -> GradSyncKey:
        return GradSyncKey(self.group)

    @property
    def name(self) -> str:
        return self.key.name


@attrs.frozen
class Group:
    key: GroupKey
    ranks: tuple[int, ...]
    # Network settings the group is created with: its members' domain when they share one,
    # CROSS_DOMAIN when they span domains, DEFAULT_TRANSPORT when the cluster declares no domains;
    # SHM: a stage boundary inside one node whose tensors go through shared memory (hetero_llm/comm/shm.py;
    # the process group is still created, with the node's own settings, for the network fallback).
    transport: str = DEFAULT_TRANSPORT

    @property
    def name(self) -> str:
        return self.key.name


# ------------------------------------------------------------------------------------------
# One rank's record


@attrs.frozen
class StageRoutes:
    """This rank's pieces of the stage boundaries, and the group each side travels in."""

    recv_f: Route | None = None
    send_f: tuple[Route, ...] = ()
    recv_b: Route | None = None
    send_b: tuple[Route, ...] = ()
    groups: tuple[tuple[Kind, P2PKey], ...] = ()  # (RECV_F | SEND_F | RECV_B | SEND_B, the group it travels in)
    # A boundary that re-chunks (stages of different cp): the runs this rank receives, from each of its senders
    # (recv_f / recv_b are then None).
    recv_f_runs: tuple[Route, ...] = ()
    recv_b_runs: tuple[Route, ...] = ()

    def group(self, kind: Kind) -> P2PKey | None:
        return dict(self.groups).get(kind)


@attrs.frozen
class ContextPlan:
    """A context-parallel rank's share of every sequence: its CP group (ring order), its index in it, and the two
    zigzag chunks of positions it holds (``model.cp_chunks``; every row of every microbatch the same)."""

    group: CPKey
    index: int
    ranks: tuple[int, ...]  # the CP group's global ranks, CP index order: the ring
    chunks: tuple[tuple[int, int], tuple[int, int]]  # [lo, hi) positions of chunk index and 2 x cp - 1 - index
    overlap: bool = True  # each ring transfer posted before the attention blocks it travels beside (cp_overlap)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def send_to(self) -> int:
        """The ring's next rank (keys and values go to it)."""
        return self.ranks[(self.index + 1) % self.size]

    @property
    def recv_from(self) -> int:
        """The ring's previous rank (keys and values come from it)."""
        return self.ranks[(self.index - 1) % self.size]


@attrs.frozen
class Shard:
    """One parameter shard a rank holds: rows [lo, hi) along ``info.shard_dim`` (or the whole of dim 0)."""

    info: ParamInfo
    lo: int
    hi: int
    replicas: int  # copies of this shard inside the rank's stage (TP size for a replicated tensor, else 1)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def coords(self) -> tuple[int | None, int, int, tuple[int, ...]]:
        """(shard dim or None: replicated, lo, hi, full shape): how checkpoints record it."""
        return self.info.shard_dim, self.lo, self.hi, self.info.shape


@attrs.frozen
class ComputeSettings:
    """How a stage computes, resolved: train.precision, the stage's recompute (else the train's), train.compile."""

    precision: Precision
    recompute: bool
    compile: bool


@attrs.frozen
class BatchShare:
    """A pipeline's contiguous rows [offset, offset + size) of the global batch, in ``microbatches`` pieces."""

    offset: int
    size: int
    microbatches: int


@attrs.frozen
class Network:
    """The settings a rank creates its groups with (``comm``)."""

    backend: Backend
    comm: CommLib
    timeout_s: float
    # (group, the environment this rank creates it under: GLOO_SOCKET_IFNAME and NCCL variables), for the
    # world and every group this rank is in (``Plan.group_env``); a group not listed is created without any.
    envs: tuple[tuple[GroupKey, tuple[tuple[str, str], ...]], ...] = ()
    # The gloo interfaces this rank's node wants, each with the transports of the groups using it (listed on
    # the node's first rank only, which warns once for the node when its host lacks one).
    node_interfaces: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @functools.cached_property  # asked for every group of the plan: the pairs made a dict once, not per group
    def _env_of(self) -> dict[GroupKey, tuple[tuple[str, str], ...]]:
        return dict(self.envs)

    def env(self, key: GroupKey) -> dict[str, str]:
        return dict(self._env_of.get(key, ()))


Slice = tuple[str, int, int, int]
"""(param name, dim, lo, hi): rows [lo, hi) along ``dim`` of the full tensor."""


@attrs.frozen
class ZeroUnit:
    """Blocks whose AdamW state ``ranks`` split; plan group ``group`` carries their collectives."""

    group: GroupKey
    ranks: tuple[int, ...]
    entries: tuple[Slice, ...]
    cuts: tuple[tuple[int, ...], ...]  # per entry: len(ranks) + 1 row boundaries, from its lo to its hi
    row_sizes: tuple[int, ...]  # per entry: elements in one row along its dim
    reduce: bool  # sum the holders' gradients first (False: TP replicas already hold the same gradient)

    def slices(self, rank: int) -> list[Slice]:
        """``rank``'s slice of every entry (some may be empty)."""
        j = self.ranks.index(rank)
        return [(name, dim, cut[j], cut[j + 1]) for (name, dim, _, _), cut in zip(self.entries, self.cuts)]

    def elements(self, rank: int) -> int:
        j = self.ranks.index(rank)
        return sum((cut[j + 1] - cut[j]) * row for cut, row in zip(self.cuts, self.row_sizes))

    @functools.cached_property  # asked per holder at every reduce-scatter: once, in one pass over the holders
    def chunk(self) -> int:
        """Elements per holder in the collectives: the largest slice (the others are padded to it)."""
        return max(
            sum((cut[j + 1] - cut[j]) * row for cut, row in zip(self.cuts, self.row_sizes))
            for j in range(len(self.ranks))
        )


@attrs.frozen
class OptimizerSlices:
    """What this rank's AdamW updates under ZeRO-1 (``zero1_slices.owned``): its slices of each unit it is in
    (the unit's group carries their reduce-scatter and all-gather), and the rest of its shards, its alone."""

    units: tuple[tuple[ZeroUnit, tuple[Slice, ...]], ...]
    local: tuple[Slice, ...]


@attrs.frozen
class Meeting:
    """Where the ranks meet: the master node's host and ``cluster.port`` (``rendezvous.endpoint`` lets
    MASTER_ADDR / MASTER_PORT override them) and the rank that serves the store there."""

    host: str
    port: int
    master: str  # the master node's name
    declared: bool  # named by cluster.master (else the first node is the master)
    server: int | None  # the lowest rank on the master node; None: it runs no rank (refused when met)
    timeout_s: float  # cluster.timeout_s: every wait of the rendezvous and the heartbeat is bounded by it
    file: str  # the layout file, for messages


@attrs.frozen
class RankPlan:
    """Everything one rank needs to train (see the module doc). Frozen; holds no ``Layout``."""

    rank: int
    world_size: int
    file: str  # the layout file, for messages
    info: RankInfo
    stage: StagePlan
    model: ModelSpec
    train: TrainSpec
    data: DataSpec
    actions: tuple[sched.Action, ...]
    dynamic: bool  # the runtime picks the order as inputs arrive (MegatronDPP); ``actions`` give the priorities
    split_backward: bool  # the actions split backwards (I then W): linear layers can put off weight gradients
    sharded_optimizer: bool  # train.optimizer = 'adamw_zero1'
    optimizer_slices: OptimizerSlices | None  # with 'adamw_zero1': what this rank's AdamW updates
    compute: ComputeSettings
    shards: tuple[Shard, ...]
    sync_blocks: tuple[SyncBlocks, ...]  # the sync block groups this rank is in, in plan order
    routes: StageRoutes
    tp_group: TPKey | None  # this rank's TP group (None when its stage has TP size 1)
    world: Group
    groups: tuple[Group, ...]  # every group of the plan, in creation order (each rank creates all of them)
    network: Network
    batch: BatchShare
    counts_loss: bool  # its summed loss is its pipeline's (last stage, TP rank 0): added into the logged loss
    hot_switching: (
        bool  # the layout has [[buckets]]: each step runs every bucket under its own layout (switching/switcher.py)
    )
    reports: bool  # prints progress and writes metrics (every rank knows the reduced loss: rank 0 does it)
    fingerprint: str  # ``Plan.fingerprint``: what every rank checks at rendezvous
    meeting: Meeting
    peers: tuple[str, ...]  # device id of every rank, for messages naming another rank
    # Every rank's shards, by rank, on the rank that writes a checkpoint's meta.json (rank 0); () on the others.
    saved_shards: tuple[tuple[Shard, ...], ...] = ()
    context: ContextPlan | None = None  # its stage's context parallelism (None: cp 1, whole sequences)

    @property
    def device(self) -> str:
        return self.info.device

    @property
    def pipeline(self) -> int:
        return self.info.pipeline

    @property
    def tp_index(self) -> int:
        return self.info.tp_index

    @property
    def cp_index(self) -> int:
        return self.info.cp_index

    @property
    def member_groups(self) -> tuple[Group, ...]:
        """The groups this rank belongs to, in creation order (the world first)."""
        return (self.world,) + tuple(g for g in self.groups if self.rank in g.ranks)

    def params_of(self) -> list[tuple[ParamInfo, int, int]]:
        """(info, lo, hi) of every shard, as ``Plan.params_of`` gives them."""
        return [(s.info, s.lo, s.hi) for s in self.shards]


# ------------------------------------------------------------------------------------------
# What --dry-run --rank R prints
