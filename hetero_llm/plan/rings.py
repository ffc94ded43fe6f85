"""Which stage-boundary pieces travel through shared-memory rings, and how big each message is: facts of the plan,
compiled once with it (``Plan.shm_links``). Pure data, no torch; ``comm/shm.py`` makes the rings from them (their
file format, headers included, is ``comm/shm_ring.py``'s)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from hetero_llm.layout import SHM, Layout, Precision
from hetero_llm.plan.rank import Group, GroupKey, Route, StagePlan
from hetero_llm.schedule import Direction


@attrs.frozen
class ShmLink:
    """One boundary piece between two ranks of a node that travels through a shared-memory ring."""

    src: int  # sending rank (the ring's only writer)
    dst: int  # receiving rank (its only reader; it creates the ring)
    direction: Direction  # activations (FWD) or their gradients (BWD)
    slots: int  # messages one step sends on it
    slot_bytes: int  # one piece of the boundary tensor, rounded up to 64
    group: GroupKey  # the plan group the ring stands in for


def shm_links(
    lay: Layout,
    groups: Sequence[Group],
    routes: Sequence[tuple[Direction, Sequence[Route]]],
    stage_of: Callable[[int], StagePlan],
    route_group: Callable[[Direction, Route], GroupKey],
) -> tuple[ShmLink, ...]:
    """Every piece of the plan's SHM boundary groups, in plan order (``compile_plan`` gives the plan's groups, its
    routes by direction, and its ``stage_of`` and ``route_group``)."""
    via = {g.key: g.transport for g in groups}
    itemsize = 2 if lay.train.precision is Precision.BF16 else 4  # boundaries travel in the compute dtype
    out = []
    for direction, pieces in routes:
        for r in pieces:
            src = stage_of(r.src)
            group = route_group(direction, r)
            if via[group] != SHM or r.src == r.dst:
                continue
            pipe = lay.pipelines[src.pipeline]
            # positions of each row it carries: a re-chunking route's runs, else the receiver's 1 / cp of them
            width = sum(n for _, _, n in r.runs) if r.runs else lay.model.seq_len // stage_of(r.dst).cp
            numel = pipe.batch // pipe.microbatches * width * lay.model.hidden
            piece = -(-numel // r.pieces) * itemsize
            out.append(
                ShmLink(r.src, r.dst, direction, pipe.microbatches * lay.train.chunks, -(-piece // 64) * 64, group)
            )
    return tuple(out)
