"""Exact enumeration of a small cluster's whole space of structures: the reference the search is measured
against (tests/unit/test_plan_space.py, bench/planner/plan_exhaustive.py), not a step of the search. Torch-free.

Every subset of the devices (``subsets``; else every device is used), every TP grouping of every node (each group
of every TP x CP shape ``plan.max_cp`` allows), every
partition of the TP groups into pipelines and every stage order, as multisets (TP groups of one node and size
are interchangeable, so each distinct structure comes once), every microbatch size and every schedule of
``plan.schedules`` (interleaved with every chunk count dividing the layers). ``search.Planner.exact`` scores
them; each is completed by the search's exact sub-solvers (the layer DP, which also picks each stage's
recompute, and the batch split).
"""

from __future__ import annotations

import itertools

from hetero_llm.planner.candidates import TPGroup
from hetero_llm.planner.moves import chunk_counts
from hetero_llm.planner.structure import SearchSpace, Structure


def all_structures(planner: SearchSpace, limit: int, subsets: bool = False) -> list | None:
    """Every structure of the space, or None when there are more than ``limit``: every TP grouping of
    every node (of every subset of its devices with ``subsets``: the rest idle), every partition of the
    groups into pipelines and every stage order, as multisets (TP groups of one node and size are
    interchangeable), every microbatch size and schedule (interleaved: every chunk count)."""
    per_node = [
        [
            shaped
            for used in (range(n.devices + 1) if subsets else [n.devices])
            for c in _cuts(used, planner.group_sizes(used))
            for shaped in _shapes(c, planner.cp_sizes)
        ]
        for n in planner.cluster.nodes
    ]
    schedules = [
        (sched, c)
        for sched in planner.limits.schedules
        for c in (chunk_counts(planner.cluster.model.layers) if sched == "interleaved" else [2])
    ]
    out = []
    for choice in itertools.product(*per_node):
        if not any(choice):
            continue
        pools: dict[tuple[str, int, int], list[TPGroup]] = {}
        for node, cut in zip(planner.cluster.nodes, choice):
            idx = 0
            for t, cp in cut:
                devices = tuple(f"{node.name}:{i}" for i in range(idx, idx + t))
                pools.setdefault((node.name, t, cp), []).append(TPGroup(node.name, node.domain, devices, node.kind, cp))
                idx += t
        names = sorted(pools)
        labels = sorted(i for i, k in enumerate(names) for _ in pools[k])
        for part in _multiset_partitions(labels):
            P = len(part)
            if P > planner.global_batch:
                continue
            for orders in itertools.product(*(_multiset_permutations(p) for p in part)):
                used = dict.fromkeys(pools, 0)
                pipes = []
                for order in orders:
                    stages = []
                    for lab in order:
                        key = names[lab]
                        stages.append(pools[key][used[key]])
                        used[key] += 1
                    pipes.append(tuple(stages))
                for rows in [r for r in range(1, planner.global_batch // P + 1) if planner.global_batch % r == 0]:
                    for sched, chunks in schedules:
                        out.append(Structure(tuple(pipes), rows, sched, chunks))
                        if len(out) > limit:
                            return None
    return out


def _shapes(cut: tuple[int, ...], cp_sizes) -> list[tuple[tuple[int, int], ...]]:
    """Every way to give the groups of ``cut`` (sizes, non-increasing) a CP size: (devices, cp) pairs, each
    multiset once (groups of one size take non-increasing CP sizes)."""
    out: list[tuple[tuple[int, int], ...]] = []

    def rec(i: int, acc: tuple[tuple[int, int], ...]) -> None:
        if i == len(cut):
            out.append(acc)
            return
        for c in cp_sizes(cut[i]):
            if not acc or acc[-1][0] != cut[i] or c <= acc[-1][1]:
                rec(i + 1, acc + ((cut[i], c),))

    rec(0, ())
    return out


def _cuts(n: int, sizes: list[int]) -> list[tuple[int, ...]]:
    """Every way to cut n devices into TP sizes (non-increasing: each multiset once)."""
    out: list[tuple[int, ...]] = []

    def rec(left: int, top: int, acc: tuple[int, ...]) -> None:
        if not left:
            out.append(acc)
            return
        for t in sizes:
            if t <= min(left, top):
                rec(left - t, t, acc + (t,))

    rec(n, n, ())
    return out


def _multiset_partitions(items: list[int]):
    """Partitions of a sorted multiset into blocks, each once (sympy's generator)."""
    from sympy.utilities.iterables import multiset_partitions

    return multiset_partitions(items)


def _multiset_permutations(items: list[int]) -> list[list[int]]:
    from sympy.utilities.iterables import multiset_permutations

    return list(multiset_permutations(items))
