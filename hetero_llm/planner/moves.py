"""Local-search moves: the structures one change away from a structure. Torch-free.

``planner`` is the ``search.Planner`` (its TP sizes, its cluster); the moves are listed in
docs/planner.md. Moves of interchangeable TP groups (same node and size) are made once, and pipelines
with the same stage kinds are changed together or one alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import attrs

from hetero_llm.planner.candidates import TPGroup
from hetero_llm.planner.cluster import Node
from hetero_llm.planner.structure import SearchSpace, Structure


def neighbours(planner: SearchSpace, st: Structure) -> Iterator[Structure]:
    """Structures one move away, deduplicated: moves of interchangeable TP groups (same node, kind and
    size) are made once, and pipelines with the same stage kinds are changed together or one alone."""
    # the pipelines as tuples: a move copies the list and replaces the pipelines it changes, so the others stay
    # the same objects (``tuple(p)`` of a tuple is ``p``), and their part of the key is built once
    pipes: list = list(st.pipelines)
    P = len(pipes)
    out: list[Structure] = []
    seen: set[tuple] = set()
    part = {id(p): tuple(g.name for g in p) for p in pipes}  # ids of the live st.pipelines only

    def make(new: list, rows: int = st.rows, schedule: str = st.schedule, chunks: int = st.chunks) -> None:
        pipelines = tuple(tuple(p) for p in new if p)
        # ``Structure.key`` of the new structure, with the unchanged pipelines' parts reused
        n_chunks = chunks if schedule == "interleaved" else 1
        k = (rows, schedule, n_chunks, tuple(part.get(id(p)) or tuple(g.name for g in p) for p in pipelines))
        if k not in seen:
            seen.add(k)
            out.append(type(st)(pipelines, rows, schedule, chunks))

    def drain() -> list[Structure]:
        """The structures made since the last drain (the moves are yielded as they are made, in order: the
        search takes the first better neighbour, and the moves after it are never built)."""
        made = out[:]
        out.clear()
        return made

    def copy(*changed: int) -> list:
        """The pipelines, with those it will change as lists of their own."""
        new = list(pipes)
        for i in changed:
            new[i] = list(pipes[i])
        return new

    def kind(g: TPGroup) -> tuple:
        return (g.node, g.tp, g.cp)

    def signature(p: list[TPGroup]) -> tuple:
        return tuple((g.kind.name, g.tp, g.domain, g.cp) for g in p)

    # one representative pipeline per signature (the slowest first), and all pipelines sharing it
    rate = [sum(g.flops for g in p) for p in pipes]
    reps: dict[tuple, list[int]] = {}
    for i in sorted(range(P), key=lambda i: (rate[i], i)):
        reps.setdefault(signature(pipes[i]), []).append(i)

    def each(transform, alone: bool = False) -> None:
        """Apply ``transform`` to one pipeline of each signature, and (unless ``alone``) to all of them."""
        for members in list(reps.values())[:4]:
            for targets in ([members[0]], members) if len(members) > 1 and not alone else ([members[0]],):
                new = list(pipes)
                ok = False
                for i in targets:
                    changed = transform(list(pipes[i]))
                    if changed is not None:
                        new[i], ok = changed, True
                if ok:
                    make(new)

    # stage order inside a pipeline
    for i in range(max((len(p) for p in pipes), default=0) - 1):
        each(
            lambda p, i=i: (
                p[:i] + [p[i + 1], p[i]] + p[i + 2 :] if i + 1 < len(p) and kind(p[i]) != kind(p[i + 1]) else None
            )
        )
    yield from drain()
    each(lambda p: p[::-1] if len(p) > 1 else None)
    yield from drain()
    for i in range(max((len(p) for p in pipes), default=0)):
        each(lambda p, i=i: p[:i] + p[i + 1 :] + [p[i]] if 0 < len(p) - 1 != i < len(p) else None)
        each(lambda p, i=i: [p[i]] + p[:i] + p[i + 1 :] if 0 < i < len(p) else None)
    yield from drain()
    # leave a TP group idle, or put an idle one to work
    for i in range(max((len(p) for p in pipes), default=0)):
        each(
            lambda p, i=i: (
                p[:i] + p[i + 1 :] if i < len(p) and len(p) > 1 and (i == 0 or kind(p[i]) != kind(p[i - 1])) else None
            )
        )
    yield from drain()
    idle = idle_groups(planner, st)  # one TP group per node with idle devices
    for g in idle:
        each(lambda p, g=g: p + [g], alone=True)
        each(lambda p, g=g: [g] + p, alone=True)
        make(pipes + [[g]])
    yield from drain()
    if P > 1:
        slow = min(range(P), key=lambda i: (rate[i], i))
        fast = max(range(P), key=lambda i: (rate[i], -i))
        pairs = [(a, b) for a in range(P) for b in range(P) if a != b] if P <= 4 else [(fast, slow), (slow, fast)]
        for src, dst in pairs:
            done = set()
            for gi, g in enumerate(pipes[src]):
                if len(pipes[src]) > 1 and kind(g) not in done:
                    done.add(kind(g))
                    new = copy(src, dst)
                    new[src].pop(gi)
                    near = [k for k, h in enumerate(new[dst]) if h.node == g.node]
                    at = near[-1] + 1 if near else len(new[dst])
                    new[dst].insert(at, g)
                    make(new)
            yield from drain()
        for a, b in pairs:
            if a < b or P > 4:
                for gi, gj in itertools.product(range(len(pipes[a])), range(len(pipes[b]))):
                    x, y = pipes[a][gi], pipes[b][gj]
                    if (x.kind, x.tp, x.domain, x.cp) != (y.kind, y.tp, y.domain, y.cp):
                        new = copy(a, b)
                        new[a][gi], new[b][gj] = y, x
                        make(new)
                yield from drain()
        i, j = sorted(range(P), key=lambda i: (rate[i], i))[:2]
        make([p for k, p in enumerate(pipes) if k not in (i, j)] + [pipes[i] + pipes[j]])
    yield from drain()
    big = max(range(P), key=lambda i: (len(pipes[i]), -i))
    if len(pipes[big]) > 1:
        half = len(pipes[big]) // 2
        make([p for k, p in enumerate(pipes) if k != big] + [pipes[big][:half], pipes[big][half:]])
    yield from drain()
    # split / merge TP groups (of no CP: a CP group changes shape by the reshape moves below)
    for pi, groups in enumerate(pipes):
        for gi, g in enumerate(groups):
            h = g.tp // 2
            if g.cp == 1 and g.tp % 2 == 0 and h in planner.tp_sizes(g.tp):
                new = copy(pi)
                new[pi][gi : gi + 1] = [attrs.evolve(g, devices=g.devices[:h]), attrs.evolve(g, devices=g.devices[h:])]
                make(new)
        for k, (ga, gb) in enumerate(zip(groups, groups[1:])):
            if (
                ga.cp == gb.cp == 1
                and ga.node == gb.node
                and ga.tp + gb.tp in planner.tp_sizes(planner.cluster.node(ga.node).devices)
            ):
                ids = sorted(ga.devices + gb.devices, key=lambda d: int(d.split(":")[1]))
                new = copy(pi)
                new[pi][k : k + 2] = [attrs.evolve(ga, devices=tuple(ids))]
                make(new)
        yield from drain()
    # context parallelism (plan.max_cp): a pipeline's groups as TP x CP otherwise (the layout gives a pipeline's
    # stages one cp), one pipeline of each signature, then all of them
    for c in range(1, planner.limits.max_cp + 1) if planner.limits.max_cp > 1 else ():
        each(lambda p, c=c: q if (q := list(reshaped(planner, p, c))) != p else None)
    yield from drain()
    for rows in (st.rows * 2, st.rows // 2):
        if rows >= 1 and planner.global_batch % rows == 0:
            make(pipes, rows=rows)
    yield from drain()
    counts = chunk_counts(planner.cluster.model.layers)
    for sch in planner.limits.schedules:  # another schedule (interleaved: with every chunk count)
        for c in counts if sch == "interleaved" else [st.chunks]:
            if (sch, c) != (st.schedule, st.chunks):
                make(pipes, schedule=sch, chunks=c)
    yield from drain()
    # last (the search takes the first better neighbour): exchange two nodes' roles, and put an idle group
    # to work between two nodes' stages
    for na, nb in node_swaps(planner, st):
        make([[relabel(g, na, nb) for g in p] for p in pipes])
    yield from drain()
    for g in idle:
        for i in range(1, max((len(p) for p in pipes), default=0)):
            each(
                lambda p, g=g, i=i: p[:i] + [g] + p[i:] if i < len(p) and p[i - 1].node != p[i].node else None,
                alone=True,
            )
    yield from drain()
    # then: a TP group to any other place of its pipeline, and a TP group halved, its second half to any place of
    # another pipeline (one move: split in place, then move a half, passes through worse plans). A small-memory
    # group must reach a stage that holds few microbatches in flight; on HexiScale's cluster (docs/planner.md) a
    # TP-4 group of 12 GB cards is halved, one half going late into the other pipeline, then a 3090 group halved
    # and one half moved further down its pipeline
    n_max = max((len(p) for p in pipes), default=0)
    for i, j in itertools.product(range(n_max), range(n_max)):
        each(lambda p, i=i, j=j: reinsert(p, i, j))
        yield from drain()
    ends = {min(range(P), key=lambda i: (rate[i], i)), max(range(P), key=lambda i: (rate[i], -i))}
    targets = set(range(P)) if P <= 4 else ends  # more pipelines: the slowest and the fastest
    for pi in [members[0] for members in list(reps.values())[:4]]:  # one pipeline per signature, as ``each``
        groups = pipes[pi]
        for gi, g in enumerate(groups):
            h = g.tp // 2
            if g.cp > 1 or g.tp % 2 or h not in planner.tp_sizes(g.tp) or (gi and kind(groups[gi - 1]) == kind(g)):
                continue
            first, second = attrs.evolve(g, devices=g.devices[:h]), attrs.evolve(g, devices=g.devices[h:])
            for dst in sorted(targets - {pi}):
                for at in range(len(pipes[dst]) + 1):
                    new = copy(pi, dst)
                    new[pi][gi] = first
                    new[dst].insert(at, second)
                    make(new)
        yield from drain()
    # last of all: the microbatch rows to the next size dividing the batch, above and below (doubling and halving
    # miss sizes such as 3 of a batch of 6: issue 23's misses under the eager/compiled pricing)
    for rows in next_divisors(planner.global_batch, st.rows):
        make(pipes, rows=rows)
    yield from drain()
    # and after them: another schedule (or chunk count) together with other microbatch rows, one move. A schedule
    # can need another microbatch count than the one the current schedule is best at (interleaving: a multiple of
    # the stages, and more of them to fill its bubble), and each change alone can be worse (bench/plan_exhaustive's
    # cluster 9: zero-bubble with 3 microbatches of 2 rows -> interleaved x2 with 6 of 1, reordered first)
    steps = row_steps(planner.global_batch, st.rows)
    retimed = [
        (sch, c, rows)
        for sch in planner.limits.schedules
        for c in (counts if sch == "interleaved" else [st.chunks])
        for rows in [st.rows] + steps
    ]
    for sch, c, rows in retimed:
        if (sch, c) != (st.schedule, st.chunks) and rows != st.rows:
            make(pipes, rows=rows, schedule=sch, chunks=c)
    yield from drain()
    # last: leave a pipeline's first or last stages idle, several at once, under this schedule or with another
    # schedule and rows (one at a time can pass through a plan interleaving cannot run: 3 stages for 4 microbatches;
    # cluster 130: 4 interleaved stages -> their last 2 with 4 chunks and 2 rows). Up to 4 pipelines (as the
    # pairs above): with more (31 on 1024 GPUs) the cuts times the schedules and rows are many plans to realize
    shorter: list[list[list[TPGroup]]] = []
    for k in range(2, n_max if P <= 4 else 0):
        for cut in (lambda p, k=k: p[k:] if k < len(p) else None, lambda p, k=k: p[:-k] if k < len(p) else None):
            for members in list(reps.values())[:4]:
                q = cut(pipes[members[0]])
                if q is not None:
                    shorter.append([q if i == members[0] else p for i, p in enumerate(pipes)])
    for new in shorter:
        make(new)
    yield from drain()
    for new in shorter:
        for sch, c, rows in retimed:
            make(new, rows=rows, schedule=sch, chunks=c)
    yield from drain()
    # last: a pipeline split in two by data parallelism (each of its TP groups halved, a half in each copy), and
    # each copy given an idle group as its last or first stage, one move: the halves alone may not fit their layers,
    # and an idle group added alone does not pay (bench/plan_exhaustive's cluster 196 under the saved-tensor memory
    # model: one TP-2 A100 stage -> two pipelines of an A100 and an RTX 3090). The first 8 idle groups, as pairs
    for pi in [members[0] for members in list(reps.values())[:4]]:
        groups = pipes[pi]
        if not all(g.cp == 1 and g.tp % 2 == 0 and g.tp // 2 in planner.tp_sizes(g.tp) for g in groups):
            continue
        copy_a = [attrs.evolve(g, devices=g.devices[: g.tp // 2]) for g in groups]
        copy_b = [attrs.evolve(g, devices=g.devices[g.tp // 2 :]) for g in groups]
        rest = [p for k, p in enumerate(pipes) if k != pi]
        for rows in [st.rows] + steps:  # twice the pipelines: fewer rows per microbatch may be what fits
            make(rest + [copy_a, copy_b], rows=rows)
            for g1, g2 in itertools.combinations(idle[:8], 2):
                make(rest + [copy_a + [g1], copy_b + [g2]], rows=rows)
                make(rest + [[g1] + copy_a, [g2] + copy_b], rows=rows)
    yield from drain()


def row_steps(n: int, d: int) -> list[int]:
    """The microbatch rows one step from ``d`` (of a batch of ``n``): doubled, halved, the next divisors above
    and below, those dividing ``n``, each once."""
    steps = [k for k in (2 * d, d // 2) if k >= 1 and n % k == 0] + next_divisors(n, d)
    return sorted(set(steps), key=steps.index)


def next_divisors(n: int, d: int) -> list[int]:
    """The divisors of ``n`` next above and next below ``d`` (those that exist)."""
    above = next((k for k in range(d + 1, n + 1) if n % k == 0), None)
    below = next((k for k in range(d - 1, 0, -1) if n % k == 0), None)
    return [k for k in (above, below) if k is not None]


def reinsert(p: list[TPGroup], i: int, j: int) -> list[TPGroup] | None:
    """``p`` with its group ``i`` moved to place ``j`` (None: a move the other moves make, or none: an end, a
    neighbour's place, or a group inside a run of its node's groups of its size, which moves as the run's first)."""
    n = len(p)
    if not (i < n and j < n) or abs(i - j) < 2 or j in (0, n - 1):
        return None
    if i and (p[i - 1].node, p[i - 1].tp, p[i - 1].cp) == (p[i].node, p[i].tp, p[i].cp):
        return None
    q = p[:i] + p[i + 1 :]
    q.insert(j, p[i])
    return q


def chunk_counts(layers: int) -> list[int]:
    """The chunk counts interleaving can run a model of ``layers`` layers with: 2 and up, dividing the layers
    (each stage holds a multiple of the chunks)."""
    return [c for c in range(2, layers + 1) if layers % c == 0]


def node_swaps(planner: SearchSpace, st: Structure, limit: int = 16) -> list[tuple[Node, Node]]:
    """Pairs of nodes (of as many devices, another kind or NIC domain) whose roles the structure can exchange:
    one hosts TP groups, the other single devices only (or stays idle). One node per (kind, domain, size,
    grouping) class; the first ``limit`` pairs in node order."""
    shape: dict[str, list[int]] = {n.name: [] for n in planner.cluster.nodes}
    for p in st.pipelines:
        for g in p:
            shape[g.node].append(len(g.devices))
    reps: dict[tuple, Node] = {}
    for n in planner.cluster.nodes:
        reps.setdefault((n.kind.name, n.domain, n.devices, tuple(sorted(shape[n.name]))), n)
    nodes = list(reps.values())
    out = []
    for i, a in enumerate(nodes):
        for b in nodes[i + 1 :]:
            if (
                a.devices == b.devices
                and (a.kind.name, a.domain) != (b.kind.name, b.domain)
                and (max(shape[a.name], default=1) > 1) != (max(shape[b.name], default=1) > 1)
            ):
                out.append((a, b))
    return out[:limit]


def relabel(g: TPGroup, a: Node, b: Node) -> TPGroup:
    """``g`` with nodes ``a`` and ``b`` exchanged (device ``a:i`` becomes ``b:i``)."""
    for x, y in ((a, b), (b, a)):
        if g.node == x.name:
            devices = tuple(f"{y.name}:{d.split(':')[1]}" for d in g.devices)
            return TPGroup(y.name, y.domain, devices, y.kind, g.cp)
    return g


def idle_groups(planner: SearchSpace, st: Structure) -> list[TPGroup]:
    """One TP group (of the largest size that fits) per node with devices the structure leaves idle."""
    used = {d for p in st.pipelines for g in p for d in g.devices}
    out = []
    for node in planner.cluster.nodes:
        free = [i for i in range(node.devices) if f"{node.name}:{i}" not in used]
        if free:
            t = max(planner.tp_sizes(len(free)))
            out.append(TPGroup(node.name, node.domain, tuple(f"{node.name}:{i}" for i in free[:t]), node.kind))
    return out


def with_cp(planner: SearchSpace, structures: list[Structure]) -> list[Structure]:
    """Each structure with every pipeline whose groups can all take it at each CP size of ``plan.max_cp`` (the
    layout gives a pipeline's stages one cp): start points for the local search's reshape moves; none when
    max_cp is 1."""
    out = []
    for c in range(2, planner.limits.max_cp + 1):
        for st in structures:
            pipes = tuple(reshaped(planner, p, c) for p in st.pipelines)
            if pipes != st.pipelines:
                out.append(attrs.evolve(st, pipelines=pipes))
    return out


def reshaped(planner: SearchSpace, groups, cp: int) -> tuple[TPGroup, ...]:
    """A pipeline's groups at CP size ``cp``, when every one of them can take it; else as they are."""
    groups = tuple(groups)
    if all(cp in planner.cp_sizes(len(g.devices)) for g in groups):
        return tuple(planner.reshape(g, cp) for g in groups)
    return groups
