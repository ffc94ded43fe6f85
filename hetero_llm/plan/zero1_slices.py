"""Which slice of every parameter block each rank updates under ZeRO-1 (``train.optimizer = 'adamw_zero1'``).

Torch-free: the optimizer (``zero1``), the memory formula (``state_elements``), the simulator's costs and
the docs all read the same slices from here.

A **unit** is a set of blocks with the same holders, whose AdamW state those holders split:

- every gradient-sync bucket of the plan (a finest common block held by ranks of several stages): the
  holders reduce-scatter its gradient (``reduce``), each updates its slice, then they all-gather it;
- the TP-replicated parameters of a stage (norms, embeddings, the head) that no other stage holds: their
  gradients are already identical on the stage's TP ranks, so each takes its slice without a reduction,
  and the TP group all-gathers the updated slices.

Everything else a rank holds (a shard of a sharded tensor that no other pipeline holds) has one holder:
it keeps its whole state, as with plain AdamW.

Slices are cut along the block's shard dim in whole rows (columns for a row-parallel weight), so every
slice is a rectangular ``(name, dim, lo, hi)`` range in the full tensor's coordinates, like a shard.
A holder's share of a block is proportional to ``tp x memory_gb``: ``tp``, the TP size of its stage for a
sharded tensor (1 for a replicated one), makes every holder of a tensor keep the same state, since a rank
of a TP-4 stage holds a quarter of the tensor and so sits in a quarter as many blocks as a TP-1 rank;
``memory_gb`` (its node's, when every holder's node declares one) then gives a bigger device more.
"""

from __future__ import annotations

import math
from typing import Protocol

from hetero_llm.layout import Layout
from hetero_llm.model.params import ParamInfo
from hetero_llm.plan.rank import GroupKey, OptimizerSlices, RankInfo, RankPlan, Slice, StagePlan, SyncBlocks, ZeroUnit


class Plan(Protocol):
    """What the slices read of a compiled plan (``plan.Plan``, which compiles them: so not imported here)."""

    @property  # read-only members: the compiled plan is frozen
    def layout(self) -> Layout: ...

    @property
    def ranks(self) -> tuple[RankInfo, ...]: ...

    @property
    def stages(self) -> tuple[StagePlan, ...]: ...

    @property
    def sync_blocks(self) -> tuple[SyncBlocks, ...]: ...

    @property
    def world_size(self) -> int: ...

    @property
    def rank_plans(self) -> tuple[RankPlan, ...]: ...

    def stage_of(self, rank: int) -> StagePlan: ...

    def tp_group(self, stage: StagePlan) -> GroupKey | None: ...

    def params_of(self, rank: int) -> list[tuple[ParamInfo, int, int]]: ...


def _row_size(info: ParamInfo, dim: int) -> int:
    return math.prod(n for d, n in enumerate(info.shape) if d != dim)


def _cut(lo: int, hi: int, weights: list[float]) -> tuple[int, ...]:
    """Row boundaries giving each holder a share of [lo, hi) proportional to its weight."""
    total, acc, out = sum(weights), 0.0, [lo]
    for w in weights[:-1]:
        acc += w
        out.append(lo + round((hi - lo) * acc / total))
    return tuple(out + [hi])


def _weights(plan: Plan, ranks: tuple[int, ...]) -> tuple[list[float], list[float]]:
    """The holders' weights for a replicated tensor and for a sharded one (``tp x memory_gb``, module doc)."""
    memory = {n.name: n.memory_gb for n in plan.layout.cluster.nodes}
    mem = [memory[plan.ranks[r].node] for r in ranks]
    if not all(m > 0 for m in mem):
        mem = [1.0] * len(ranks)
    return mem, [m * plan.stage_of(r).tp for m, r in zip(mem, ranks)]


def units(plan: Plan) -> tuple[ZeroUnit, ...]:
    """Every unit of the plan, in plan order (every rank computes the same tuple)."""
    infos = {p.name: p for st in plan.stages for p in st.params(plan.layout.model)}

    def unit(group: GroupKey, ranks: tuple[int, ...], entries: tuple[Slice, ...], reduce: bool) -> ZeroUnit:
        weights = _weights(plan, ranks)  # once per unit, not per entry: a unit can hold hundreds of blocks
        cuts = tuple(_cut(lo, hi, weights[infos[name].shard_dim is not None]) for name, _, lo, hi in entries)
        sizes = tuple(_row_size(infos[name], dim) for name, dim, _, _ in entries)
        return ZeroUnit(group, ranks, entries, cuts, sizes, reduce)

    out = [unit(b.key, b.group, b.entries, True) for b in plan.sync_blocks]
    synced = {e[0] for b in plan.sync_blocks for e in b.entries}
    for st in plan.stages:
        if st.tp == 1:
            continue
        replicated = tuple(
            (p.name, 0, 0, p.shape[0])
            for p in st.params(plan.layout.model)
            if p.shard_dim is None and p.name not in synced
        )
        if replicated:
            key = plan.tp_group(st)
            assert key is not None  # a TP group: tp > 1 here
            out.append(unit(key, st.ranks, replicated, False))
    return tuple(out)


def by_rank(all_units: tuple[ZeroUnit, ...]) -> dict[int, list[ZeroUnit]]:
    """The units each rank is in, in plan order (what ``owned`` filters ``all_units`` to, for every rank at once)."""
    out: dict[int, list[ZeroUnit]] = {}
    for u in all_units:
        for r in u.ranks:
            out.setdefault(r, []).append(u)
    return out


def owned(
    plan: Plan, rank: int, all_units: tuple[ZeroUnit, ...] | None = None, in_units: list[ZeroUnit] | None = None
) -> tuple[list[tuple[ZeroUnit, list[Slice]]], list[Slice]]:
    """What ``rank`` updates: its slices of each unit it is in, and the rest of its shards (its alone).
    ``in_units``: the units ``rank`` is in, when the caller has them (``by_rank``), else found in ``all_units``."""
    if in_units is None:
        all_units = units(plan) if all_units is None else all_units
        in_units = [u for u in all_units if rank in u.ranks]
    mine = [(u, u.slices(rank)) for u in in_units]
    covered: dict[str, list[tuple[int, int]]] = {}
    for u, _ in mine:
        for name, _, lo, hi in u.entries:
            covered.setdefault(name, []).append((lo, hi))
    rest = []
    for info, lo, hi in plan.params_of(rank):
        dim = info.shard_dim or 0
        at = lo
        for a, b in sorted(covered.get(info.name, [])):
            if a > at:
                rest.append((info.name, dim, at, a))
            at = max(at, b)
        if at < hi:
            rest.append((info.name, dim, at, hi))
    return mine, rest


def state_elements(
    plan: Plan, rank: int, zero1: bool, in_units: list[ZeroUnit] | None = None, slices: OptimizerSlices | None = None
) -> int:
    """Elements per AdamW moment that ``rank`` keeps: its whole shards with 'adamw', its slices with ZeRO-1
    (``in_units``: the units it is in, as ``owned`` takes them; ``slices``: its RankPlan's, ``owned``'s answer).

    Bytes of optimizer state = 2 moments x 4 bytes x this (float32 exp_avg and exp_avg_sq).
    """
    held = plan.params_of(rank)
    if not zero1:
        return sum(_row_size(info, info.shard_dim or 0) * (hi - lo) for info, lo, hi in held)
    mine, rest = (slices.units, slices.local) if slices is not None else owned(plan, rank, in_units=in_units)
    infos = {info.name: info for info, _, _ in held}
    return sum(u.elements(rank) for u, _ in mine) + sum(_row_size(infos[n], d) * (hi - lo) for n, d, lo, hi in rest)


def _state_mib(plan: Plan) -> list[tuple[float, float]]:
    """Per rank: MiB of AdamW moments under 'adamw' and under 'adamw_zero1' (each rank's slices as its RankPlan has
    them, else the units computed once)."""
    slices = [rp.optimizer_slices for rp in plan.rank_plans] or [None] * plan.world_size
    in_units = by_rank(units(plan)) if None in slices else {}
    mib = 8 / 2**20
    return [
        (mib * state_elements(plan, r, False), mib * state_elements(plan, r, True, in_units.get(r, []), slices[r]))
        for r in range(plan.world_size)
    ]


_TITLE = "optimizer state per rank (AdamW moments, 8 bytes per element; train.optimizer = 'adamw_zero1')"


def _factor(plain: float, zero: float) -> float:
    return plain / zero if zero else float("inf")


def describe(plan: Plan, full: bool = True) -> str:
    """The ``--dry-run`` table of AdamW state per rank, plain and ZeRO-1 (two float32 moments per element);
    not ``full``: its range over the ranks, in two lines."""
    mib = _state_mib(plan)
    if not full:
        plains, zeros, factors = ([p for p, _ in mib], [z for _, z in mib], [_factor(p, z) for p, z in mib])
        return (
            f"{_TITLE}:\n  adamw {min(plains):.3f}-{max(plains):.3f} MiB, adamw_zero1 {min(zeros):.3f}-{max(zeros):.3f} "
            f"MiB, factor {min(factors):.2f}-{max(factors):.2f}"
        )
    lines = [f"{_TITLE}:", "rank  adamw MiB  adamw_zero1 MiB  factor"]
    for rank, (plain, zero) in enumerate(mib):
        lines.append(f"{rank:<5} {plain:<10.3f} {zero:<16.3f} {_factor(plain, zero):.2f}")
    return "\n".join(lines)
