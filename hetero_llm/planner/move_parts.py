"""What the local-search moves (moves.py) are built from: a structure's idle TP groups, the nodes whose roles
it can exchange, a group moved to another place of its pipeline, the microbatch rows one step away, the chunk
counts interleaving can run, a pipeline's groups at another CP size. Torch-free."""

from __future__ import annotations

import attrs

from hetero_llm.planner.candidates import TPGroup
from hetero_llm.planner.cluster import Node
from hetero_llm.planner.structure import SearchSpace, Structure


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
