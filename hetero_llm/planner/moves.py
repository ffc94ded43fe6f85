"""Local-search moves: the structures one change away from a structure. Torch-free.

``planner`` is the ``search.Planner`` (its TP sizes, its cluster); the moves are listed in
docs/planner.md. ``neighbours`` yields them family by family (a generator each, in the order of ``FAMILIES``),
sharing one ``Moves``: the structure's pipelines and the keys made so far. Moves of interchangeable TP groups
(same node and size) are made once, and pipelines with the same stage kinds are changed together or one alone.
What the moves are built from is in move_parts.py.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator

import attrs

from hetero_llm.planner.candidates import TPGroup
from hetero_llm.planner.move_parts import (
    chunk_counts,
    idle_groups,
    next_divisors,
    node_swaps,
    reinsert,
    relabel,
    reshaped,
    row_steps,
)
from hetero_llm.planner.structure import SearchSpace, Structure


def neighbours(planner: SearchSpace, st: Structure) -> Iterator[Structure]:
    """Structures one move away, deduplicated: moves of interchangeable TP groups (same node, kind and
    size) are made once, and pipelines with the same stage kinds are changed together or one alone. The moves
    come family by family in the order of ``FAMILIES`` (the search takes the first better neighbour: the order
    is the search's), each yielded as it is made."""
    made = Moves(planner, st)
    for family in FAMILIES:
        yield from family(made)


def group_key(g: TPGroup) -> tuple:
    """TP groups of one key are interchangeable in a pipeline: the same node, TP and CP size."""
    return (g.node, g.tp, g.cp)


def signature(p: list[TPGroup]) -> tuple:
    """Pipelines of one signature have the same stage kinds: their moves are made together or one alone."""
    return tuple((g.kind.name, g.tp, g.domain, g.cp) for g in p)


class Moves:
    """One structure's moves in the making: its pipelines, the keys made so far, the moves made and not yet
    yielded, and what several families share (built when a family first needs it: the moves after the first
    better neighbour are never built)."""

    def __init__(self, planner: SearchSpace, st: Structure) -> None:
        self.planner, self.st = planner, st
        # the pipelines as tuples: a move copies the list and replaces the pipelines it changes, so the others
        # stay the same objects (``tuple(p)`` of a tuple is ``p``), and their part of the key is built once
        self.pipes: list = list(st.pipelines)
        self.P = len(self.pipes)
        self.n_max = max((len(p) for p in self.pipes), default=0)  # the most stages of a pipeline
        self.out: list[Structure] = []
        self.seen: set[tuple] = set()
        self.part = {id(p): tuple(g.name for g in p) for p in self.pipes}  # ids of the live st.pipelines only
        # one representative pipeline per signature (the slowest first), and all pipelines sharing it: the
        # first 4 signatures
        self.rate = [sum(g.flops for g in p) for p in self.pipes]
        reps: dict[tuple, list[int]] = {}
        for i in sorted(range(self.P), key=lambda i: (self.rate[i], i)):
            reps.setdefault(signature(self.pipes[i]), []).append(i)
        self.reps = list(reps.values())[:4]

    def make(self, new: list, rows: int | None = None, schedule: str | None = None, chunks: int | None = None) -> None:
        """Add the structure of pipelines ``new`` (the empty ones dropped; rows, schedule and chunks: the
        structure's unless given) unless it was made before."""
        st = self.st
        rows = st.rows if rows is None else rows
        schedule = st.schedule if schedule is None else schedule
        chunks = st.chunks if chunks is None else chunks
        pipelines = tuple(tuple(p) for p in new if p)
        # ``Structure.key`` of the new structure, with the unchanged pipelines' parts reused
        n_chunks = chunks if schedule == "interleaved" else 1
        part = self.part
        k = (rows, schedule, n_chunks, tuple(part.get(id(p)) or tuple(g.name for g in p) for p in pipelines))
        if k not in self.seen:
            self.seen.add(k)
            self.out.append(type(st)(pipelines, rows, schedule, chunks))

    def drain(self) -> list[Structure]:
        """The structures made since the last drain (the moves are yielded as they are made, in order: the
        search takes the first better neighbour, and the moves after it are never built)."""
        made = self.out[:]
        self.out.clear()
        return made

    def copy(self, *changed: int) -> list:
        """The pipelines, with those it will change as lists of their own."""
        new = list(self.pipes)
        for i in changed:
            new[i] = list(self.pipes[i])
        return new

    def each(self, transform: Callable[..., list[TPGroup] | None], alone: bool = False) -> None:
        """Apply ``transform`` to one pipeline of each signature, and (unless ``alone``) to all of them."""
        pipes = self.pipes
        for members in self.reps:
            for targets in ([members[0]], members) if len(members) > 1 and not alone else ([members[0]],):
                new = list(pipes)
                ok = False
                for i in targets:
                    changed = transform(list(pipes[i]))
                    if changed is not None:
                        new[i], ok = changed, True
                if ok:
                    self.make(new)

    def slowest(self) -> int:
        """The pipeline of the least FLOP/s (the first of equals)."""
        return min(range(self.P), key=lambda i: (self.rate[i], i))

    def fastest(self) -> int:
        """The pipeline of the most FLOP/s (the first of equals)."""
        return max(range(self.P), key=lambda i: (self.rate[i], -i))

    @functools.cached_property
    def idle(self) -> list[TPGroup]:
        return idle_groups(self.planner, self.st)  # one TP group per node with idle devices

    @functools.cached_property
    def pairs(self) -> list[tuple[int, int]]:
        """The pipelines (source, destination) that TP groups move or swap between: every pair of up to 4
        pipelines, else the fastest and the slowest."""
        P = self.P
        if P <= 1:
            return []
        return (
            [(a, b) for a in range(P) for b in range(P) if a != b]
            if P <= 4
            else [(self.fastest(), self.slowest()), (self.slowest(), self.fastest())]
        )

    @functools.cached_property
    def counts(self) -> list[int]:
        return chunk_counts(self.planner.cluster.model.layers)

    @functools.cached_property
    def retimed(self) -> list[tuple[str, int, int]]:
        """(schedule, chunks, rows): each schedule (interleaved: with every chunk count), at the structure's
        microbatch rows or one step from them."""
        st = self.st
        steps = row_steps(self.planner.global_batch, st.rows)
        return [
            (sch, c, rows)
            for sch in self.planner.limits.schedules
            for c in (self.counts if sch == "interleaved" else [st.chunks])
            for rows in [st.rows] + steps
        ]

    @functools.cached_property
    def shorter(self) -> list[list]:
        """The pipelines with one pipeline of each signature (up to 4 pipelines) losing its first or last k >= 2
        stages."""
        out: list[list] = []
        for k in range(2, self.n_max if self.P <= 4 else 0):
            for cut in (lambda p, k=k: p[k:] if k < len(p) else None, lambda p, k=k: p[:-k] if k < len(p) else None):
                for members in self.reps:
                    q = cut(self.pipes[members[0]])
                    if q is not None:
                        out.append([q if i == members[0] else p for i, p in enumerate(self.pipes)])
        return out


# ------------------------------------------------------------------------------------ the move families


def swap_neighbour_stages(m: Moves) -> Iterator[Structure]:
    """Stage order inside a pipeline: two neighbouring stages (not interchangeable) exchanged."""
    for i in range(m.n_max - 1):
        m.each(
            lambda p, i=i: (
                p[:i] + [p[i + 1], p[i]] + p[i + 2 :]
                if i + 1 < len(p) and group_key(p[i]) != group_key(p[i + 1])
                else None
            )
        )
    yield from m.drain()


def reverse_pipeline(m: Moves) -> Iterator[Structure]:
    m.each(lambda p: p[::-1] if len(p) > 1 else None)
    yield from m.drain()


def stage_to_an_end(m: Moves) -> Iterator[Structure]:
    """A stage moved last, or first."""
    for i in range(m.n_max):
        m.each(lambda p, i=i: p[:i] + p[i + 1 :] + [p[i]] if 0 < len(p) - 1 != i < len(p) else None)
        m.each(lambda p, i=i: [p[i]] + p[:i] + p[i + 1 :] if 0 < i < len(p) else None)
    yield from m.drain()


def leave_group_idle(m: Moves) -> Iterator[Structure]:
    """A stage's TP group left idle (the first of a run of interchangeable groups)."""
    for i in range(m.n_max):
        m.each(
            lambda p, i=i: (
                p[:i] + p[i + 1 :]
                if i < len(p) and len(p) > 1 and (i == 0 or group_key(p[i]) != group_key(p[i - 1]))
                else None
            )
        )
    yield from m.drain()


def put_idle_to_work(m: Moves) -> Iterator[Structure]:
    """An idle group as a pipeline's last or first stage, or as a pipeline of its own."""
    for g in m.idle:
        m.each(lambda p, g=g: p + [g], alone=True)
        m.each(lambda p, g=g: [g] + p, alone=True)
        m.make(m.pipes + [[g]])
    yield from m.drain()


def move_between_pipelines(m: Moves) -> Iterator[Structure]:
    """A TP group moved to another pipeline, beside that pipeline's groups of its node (else last)."""
    for src, dst in m.pairs:
        done = set()
        for gi, g in enumerate(m.pipes[src]):
            if len(m.pipes[src]) > 1 and group_key(g) not in done:
                done.add(group_key(g))
                new = m.copy(src, dst)
                new[src].pop(gi)
                near = [k for k, h in enumerate(new[dst]) if h.node == g.node]
                at = near[-1] + 1 if near else len(new[dst])
                new[dst].insert(at, g)
                m.make(new)
        yield from m.drain()


def swap_between_pipelines(m: Moves) -> Iterator[Structure]:
    """Two TP groups of two pipelines (not of one signature) exchanged."""
    pipes = m.pipes
    for a, b in m.pairs:
        if a < b or m.P > 4:
            for gi, gj in itertools.product(range(len(pipes[a])), range(len(pipes[b]))):
                x, y = pipes[a][gi], pipes[b][gj]
                if (x.kind, x.tp, x.domain, x.cp) != (y.kind, y.tp, y.domain, y.cp):
                    new = m.copy(a, b)
                    new[a][gi], new[b][gj] = y, x
                    m.make(new)
            yield from m.drain()


def merge_slowest_pipelines(m: Moves) -> Iterator[Structure]:
    """The two slowest pipelines as one."""
    if m.P > 1:
        i, j = sorted(range(m.P), key=lambda i: (m.rate[i], i))[:2]
        m.make([p for k, p in enumerate(m.pipes) if k not in (i, j)] + [m.pipes[i] + m.pipes[j]])
    yield from m.drain()


def split_longest_pipeline(m: Moves) -> Iterator[Structure]:
    """The pipeline of the most stages cut in two halves."""
    pipes = m.pipes
    big = max(range(m.P), key=lambda i: (len(pipes[i]), -i))
    if len(pipes[big]) > 1:
        half = len(pipes[big]) // 2
        m.make([p for k, p in enumerate(pipes) if k != big] + [pipes[big][:half], pipes[big][half:]])
    yield from m.drain()


def split_or_merge_groups(m: Moves) -> Iterator[Structure]:
    """A TP group split in two stages, or two neighbouring stages of one node merged into one group (of no CP:
    a CP group changes shape by ``reshape_to_cp``)."""
    planner = m.planner
    for pi, groups in enumerate(m.pipes):
        for gi, g in enumerate(groups):
            h = g.tp // 2
            if g.cp == 1 and g.tp % 2 == 0 and h in planner.tp_sizes(g.tp):
                new = m.copy(pi)
                new[pi][gi : gi + 1] = [attrs.evolve(g, devices=g.devices[:h]), attrs.evolve(g, devices=g.devices[h:])]
                m.make(new)
        for k, (ga, gb) in enumerate(zip(groups, groups[1:])):
            if (
                ga.cp == gb.cp == 1
                and ga.node == gb.node
                and ga.tp + gb.tp in planner.tp_sizes(planner.cluster.node(ga.node).devices)
            ):
                ids = sorted(ga.devices + gb.devices, key=lambda d: int(d.split(":")[1]))
                new = m.copy(pi)
                new[pi][k : k + 2] = [attrs.evolve(ga, devices=tuple(ids))]
                m.make(new)
        yield from m.drain()


def reshape_to_cp(m: Moves) -> Iterator[Structure]:
    """Context parallelism (plan.max_cp): a pipeline's groups as TP x CP otherwise (the layout gives a
    pipeline's stages one cp), one pipeline of each signature, then all of them."""
    planner = m.planner
    for c in range(1, planner.limits.max_cp + 1) if planner.limits.max_cp > 1 else ():
        m.each(lambda p, c=c: q if (q := list(reshaped(planner, p, c))) != p else None)
    yield from m.drain()


def double_or_halve_rows(m: Moves) -> Iterator[Structure]:
    for rows in (m.st.rows * 2, m.st.rows // 2):
        if rows >= 1 and m.planner.global_batch % rows == 0:
            m.make(m.pipes, rows=rows)
    yield from m.drain()


def other_schedule(m: Moves) -> Iterator[Structure]:
    """Another schedule (interleaved: with every chunk count)."""
    st = m.st
    for sch in m.planner.limits.schedules:
        for c in m.counts if sch == "interleaved" else [st.chunks]:
            if (sch, c) != (st.schedule, st.chunks):
                m.make(m.pipes, schedule=sch, chunks=c)
    yield from m.drain()


def exchange_nodes(m: Moves) -> Iterator[Structure]:
    """Late (the search takes the first better neighbour): two nodes' roles exchanged (``node_swaps``)."""
    for na, nb in node_swaps(m.planner, m.st):
        m.make([[relabel(g, na, nb) for g in p] for p in m.pipes])
    yield from m.drain()


def idle_between_nodes(m: Moves) -> Iterator[Structure]:
    """An idle group put to work between two nodes' stages."""
    for g in m.idle:
        for i in range(1, m.n_max):
            m.each(
                lambda p, g=g, i=i: p[:i] + [g] + p[i:] if i < len(p) and p[i - 1].node != p[i].node else None,
                alone=True,
            )
    yield from m.drain()


# then: a TP group to any other place of its pipeline, and a TP group halved, its second half to any place of
# another pipeline (one move: split in place, then move a half, passes through worse plans). A small-memory
# group must reach a stage that holds few microbatches in flight; on HexiScale's cluster (docs/planner.md) a
# TP-4 group of 12 GB cards is halved, one half going late into the other pipeline, then a 3090 group halved
# and one half moved further down its pipeline


def group_anywhere(m: Moves) -> Iterator[Structure]:
    """A TP group to any other place of its pipeline (``reinsert``)."""
    for i, j in itertools.product(range(m.n_max), range(m.n_max)):
        m.each(lambda p, i=i, j=j: reinsert(p, i, j))
        yield from m.drain()


def halve_into_other_pipeline(m: Moves) -> Iterator[Structure]:
    """A TP group halved in place, its second half to any place of another pipeline (with more than 4
    pipelines: of the slowest and the fastest); one pipeline per signature, as ``Moves.each``."""
    planner, pipes = m.planner, m.pipes
    ends = {m.slowest(), m.fastest()}
    targets = set(range(m.P)) if m.P <= 4 else ends
    for pi in [members[0] for members in m.reps]:
        groups = pipes[pi]
        for gi, g in enumerate(groups):
            h = g.tp // 2
            if (
                g.cp > 1
                or g.tp % 2
                or h not in planner.tp_sizes(g.tp)
                or (gi and group_key(groups[gi - 1]) == group_key(g))
            ):
                continue
            first, second = attrs.evolve(g, devices=g.devices[:h]), attrs.evolve(g, devices=g.devices[h:])
            for dst in sorted(targets - {pi}):
                for at in range(len(pipes[dst]) + 1):
                    new = m.copy(pi, dst)
                    new[pi][gi] = first
                    new[dst].insert(at, second)
                    m.make(new)
        yield from m.drain()


def next_divisor_rows(m: Moves) -> Iterator[Structure]:
    """Last of all: the microbatch rows to the next size dividing the batch, above and below (doubling and
    halving miss sizes such as 3 of a batch of 6: issue 23's misses under the eager/compiled pricing)."""
    for rows in next_divisors(m.planner.global_batch, m.st.rows):
        m.make(m.pipes, rows=rows)
    yield from m.drain()


def schedule_with_rows(m: Moves) -> Iterator[Structure]:
    """And after them: another schedule (or chunk count) together with other microbatch rows, one move. A
    schedule can need another microbatch count than the one the current schedule is best at (interleaving: a
    multiple of the stages, and more of them to fill its bubble), and each change alone can be worse
    (bench/plan_exhaustive's cluster 9: zero-bubble with 3 microbatches of 2 rows -> interleaved x2 with 6 of 1,
    reordered first)."""
    st = m.st
    for sch, c, rows in m.retimed:
        if (sch, c) != (st.schedule, st.chunks) and rows != st.rows:
            m.make(m.pipes, rows=rows, schedule=sch, chunks=c)
    yield from m.drain()


def shorten_pipeline(m: Moves) -> Iterator[Structure]:
    """Last: a pipeline's first or last stages left idle, several at once (``Moves.shorter``), under this
    schedule, then with another schedule and rows (one at a time can pass through a plan interleaving cannot
    run: 3 stages for 4 microbatches; cluster 130: 4 interleaved stages -> their last 2 with 4 chunks and 2
    rows). Up to 4 pipelines (as the pairs above): with more (31 on 1024 GPUs) the cuts times the schedules and
    rows are many plans to realize."""
    for new in m.shorter:
        m.make(new)
    yield from m.drain()


def shorten_and_retime(m: Moves) -> Iterator[Structure]:
    for new in m.shorter:
        for sch, c, rows in m.retimed:
            m.make(new, rows=rows, schedule=sch, chunks=c)
    yield from m.drain()


def split_by_data_parallelism(m: Moves) -> Iterator[Structure]:
    """Last: a pipeline split in two by data parallelism (each of its TP groups halved, a half in each copy),
    and each copy given an idle group as its last or first stage, one move: the halves alone may not fit their
    layers, and an idle group added alone does not pay (bench/plan_exhaustive's cluster 196 under the
    saved-tensor memory model: one TP-2 A100 stage -> two pipelines of an A100 and an RTX 3090). The first 8
    idle groups, as pairs."""
    planner, st = m.planner, m.st
    steps = row_steps(planner.global_batch, st.rows)
    for pi in [members[0] for members in m.reps]:
        groups = m.pipes[pi]
        if not all(g.cp == 1 and g.tp % 2 == 0 and g.tp // 2 in planner.tp_sizes(g.tp) for g in groups):
            continue
        copy_a = [attrs.evolve(g, devices=g.devices[: g.tp // 2]) for g in groups]
        copy_b = [attrs.evolve(g, devices=g.devices[g.tp // 2 :]) for g in groups]
        rest = [p for k, p in enumerate(m.pipes) if k != pi]
        for rows in [st.rows] + steps:  # twice the pipelines: fewer rows per microbatch may be what fits
            m.make(rest + [copy_a, copy_b], rows=rows)
            for g1, g2 in itertools.combinations(m.idle[:8], 2):
                m.make(rest + [copy_a + [g1], copy_b + [g2]], rows=rows)
                m.make(rest + [[g1] + copy_a, [g2] + copy_b], rows=rows)
    yield from m.drain()


# the search's order of the moves (it takes the first better neighbour): docs/planner.md lists them
FAMILIES: tuple[Callable[[Moves], Iterator[Structure]], ...] = (
    swap_neighbour_stages,
    reverse_pipeline,
    stage_to_an_end,
    leave_group_idle,
    put_idle_to_work,
    move_between_pipelines,
    swap_between_pipelines,
    merge_slowest_pipelines,
    split_longest_pipeline,
    split_or_merge_groups,
    reshape_to_cp,
    double_or_halve_rows,
    other_schedule,
    exchange_nodes,
    idle_between_nodes,
    group_anywhere,
    halve_into_other_pipeline,
    next_divisor_rows,
    schedule_with_rows,
    shorten_pipeline,
    shorten_and_retime,
    split_by_data_parallelism,
)
