"""The sweep: the structures the search starts from (TP sizes per device kind, pipeline counts, two ways of
dealing TP groups to pipelines, microbatch rows), pruned by the compute lower bound and ranked by a
closed-form 1F1B estimate; and the error for a cluster where nothing fits. Torch-free."""

from __future__ import annotations

import heapq
import itertools
import math

from hetero_llm.errors import LayoutError
from hetero_llm.planner.candidates import Candidate, TPGroup
from hetero_llm.planner.cluster import Cluster
from hetero_llm.planner.cost import PlannerCostModel
from hetero_llm.planner.structure import SearchSpace, Structure

INF = math.inf


class Dealer:
    """TP groups into pipelines, domain by domain: contiguous runs, or speed-balanced (LPT). What does not depend
    on the number of pipelines (the groups by domain, their order for the balanced mode, the stage order) is
    worked out once per list of groups, and the groups are dealt as indices into ``groups``."""

    def __init__(self, planner: SearchSpace, groups: list[TPGroup]):
        self.groups = groups
        flops = [g.flops for g in groups]
        by_domain: dict[str, list[int]] = {}
        for j, g in enumerate(groups):
            by_domain.setdefault(g.domain, []).append(j)
        node_order = planner.node_order
        self.domains = []  # per domain in order: its groups, their flops, and (flops, group) by falling speed
        for d in sorted(by_domain, key=lambda d: planner.domain_order.get(d, 0)):
            js = by_domain[d]
            fast = sorted(js, key=lambda j: (-flops[j], node_order[groups[j].node], groups[j].devices))
            self.domains.append((js, [flops[j] for j in js], [(flops[j], j) for j in fast]))
        # each pipeline in planner.order's stage order: a total order (devices differ), so the one of all the groups
        position = {id(g): i for i, g in enumerate(planner.order(groups))}
        self.rank = [position[id(g)] for g in groups]

    def deal(self, P: int, balanced: bool) -> tuple[tuple[TPGroup, ...], ...]:
        """The groups into ``P`` pipelines (fewer when there are fewer groups), each in stage order."""
        pipes: list[list[int]] = [[] for _ in range(P)]
        load = [0.0] * P
        for js, flops, fast in self.domains:
            if balanced:  # each group to the least loaded pipeline, min (load, index): a heap of exactly that
                least = [(load[i], i) for i in range(P)]
                heapq.heapify(least)
                replace = heapq.heapreplace  # pop then push: the keys are distinct, so the same pipelines
                for f, j in fast:
                    i = least[0][1]
                    pipes[i].append(j)
                    load[i] += f
                    replace(least, (load[i], i))
            else:
                base, extra = divmod(len(js), P)
                lo = 0
                # the pipelines with the least compute so far get the extra groups
                for rank, i in enumerate(sorted(range(P), key=lambda i: (load[i], i))):
                    n = base + (rank < extra)
                    pipes[i] += js[lo : lo + n]
                    load[i] += sum(flops[lo : lo + n])
                    lo += n
        groups, key = self.groups, self.rank.__getitem__
        return tuple(tuple(groups[j] for j in sorted(p, key=key)) for p in pipes if p)


def pipeline_counts(planner: SearchSpace, n_groups: int) -> list[int]:
    top = min(n_groups, planner.global_batch)
    if top <= 12:
        return list(range(1, top + 1))
    out, p = set(range(1, 9)), 8.0
    while p < top:
        p *= 1.25
        out.add(min(top, int(round(p))))
    out.add(top)
    return sorted(out)


def row_options(planner: SearchSpace, P: int) -> list[int]:
    divisors = [d for d in range(1, planner.global_batch // P + 1) if planner.global_batch % d == 0]
    small = [d for d in divisors if d & (d - 1) == 0][:5]  # 1, 2, 4, 8, 16 when they divide
    # and the five smallest divisors (3 of a batch of 6: doubling and halving never reach it from 1 or 2)
    return sorted(set(small + divisors[:5] + divisors[-1:]))


def tp_menus(planner: SearchSpace) -> list[dict[str, int]]:
    kinds: dict[str, int] = {}
    for n in planner.cluster.nodes:
        kinds[n.kind.name] = max(kinds.get(n.kind.name, 0), n.devices)
    options = {k: planner.tp_sizes(d) for k, d in kinds.items()}
    names = sorted(options)
    combos = list(itertools.product(*(options[k] for k in names)))
    if len(combos) > 64:  # many kinds: the same TP size everywhere (capped per node), plus each kind alone
        sizes = sorted({t for k in names for t in options[k]})
        combos = [tuple(max(s for s in options[k] if s <= t) for k in names) for t in sizes]
    return [dict(zip(names, c)) for c in combos]


def idle_options(planner: SearchSpace) -> list[tuple[int, str, bool] | None]:
    """What the sweep may leave idle: nothing, each device kind or each NIC domain (when there are several),
    or all but one kind or domain (when there are three or more): (0 = kind or 1 = domain, name, keep only);
    options that keep the same nodes come once.
    A slow kind, or a domain behind a slow network, can cost more than it adds."""
    kinds = sorted({n.kind.name for n in planner.cluster.nodes})
    domains = sorted({n.domain for n in planner.cluster.nodes}, key=lambda d: (planner.domain_order.get(d, 0), d))
    out: list[tuple[int, str, bool] | None] = [None]
    for what, names in ((0, kinds), (1, domains)):
        out += [(what, x, False) for x in names] if len(names) > 1 else []
        out += [(what, x, True) for x in names] if len(names) > 2 else []
    # each set of nodes once (a kind can be a whole domain)
    unique: dict[tuple[str, ...], tuple[int, str, bool] | None] = {}
    for drop in out:
        kept = tuple(
            n.name
            for n in planner.cluster.nodes
            if drop is None or ((n.kind.name, n.domain)[drop[0]] == drop[1]) == drop[2]
        )
        unique.setdefault(kept, drop)
    return [drop for kept, drop in unique.items() if kept]


def _kept(g: TPGroup, drop: tuple[int, str, bool] | None) -> bool:
    if drop is None:
        return True
    what, name, only = drop
    return ((g.kind.name, g.domain)[what] == name) == only


def sweep(planner: SearchSpace, keep: int) -> list[Structure]:
    """The ``keep`` best structures by the closed-form estimate. The budget in work (``planner.sweep_limit``
    structures realized) is shared equally by the idle options, so that each is swept at any size."""
    found: list[tuple[float, int, Structure]] = []
    seen = set()
    work = planner.cost.model_flops_per_step()
    options = idle_options(planner)
    share = max(1, planner.sweep_limit // len(options))
    realized = [0] * len(options)  # structures realized per idle option
    for menu, (k, drop) in itertools.product(tp_menus(planner), enumerate(options)):
        groups = [g for g in planner.groups(menu) if _kept(g, drop)]
        if not groups or realized[k] >= share:
            continue
        # an estimate is at least the step's FLOPs over these groups' peak: skip what cannot enter the top
        lb_used = work / sum(g.flops for g in groups)
        if len(found) >= keep and lb_used >= found[keep - 1][0]:
            continue
        dealer = Dealer(planner, groups)
        for P, balanced in itertools.product(pipeline_counts(planner, len(groups)), (False, True)):
            pipes = dealer.deal(P, balanced)
            sig = tuple(tuple(g.name for g in p) for p in pipes)
            if sig in seen:
                continue
            seen.add(sig)
            for rows in row_options(planner, len(pipes)):
                if (len(found) >= keep and lb_used >= found[keep - 1][0]) or realized[k] >= share:
                    break
                realized[k] += 1
                st = Structure(pipes, rows)
                cand = planner.realize(st)
                if cand is None:
                    continue
                # past the keep-th best, an entry never returns to the top (entries only push it down), so there
                # its estimate's compute part, a lower bound, places it as well (its index and the list's length
                # are the same either way)
                est = planner.estimate(cand, found[keep - 1][0] if len(found) >= keep else INF)
                found.append((est, len(found), st))
                found.sort(key=lambda x: (x[0], x[1]))
                del found[keep * 4 :]
            if planner.out_of_time(0.4):  # the safety net: leave the local search most of the cap
                return [st for _, _, st in found[:keep]]
    return [st for _, _, st in found[:keep]]


def infeasible_error(cluster: Cluster, cost: PlannerCostModel, cand: Candidate) -> LayoutError:
    """Nothing fits: name the stage of the closest candidate that is furthest over, and by how much."""
    score = cost.score(cand)
    p, s, over = score.worst_memory()
    stage = cand.pipelines[p].stages[s]
    need = score.memory[p][s] / 1e9
    have = score.capacity[p][s] / 1e9
    return LayoutError(
        cluster.file,
        "cluster",
        f"nothing fits in memory: the closest plan's pipeline {p} stage {s} "
        f"({stage.layers} layers on {', '.join(stage.group.devices)}, {stage.group.kind.name}) needs "
        f"{need:.3g} GB per device but has {have:.3g} GB ({over / 1e9:.3g} GB over; add devices, "
        f"use bigger ones, or lower train.global_batch or plan.memory_margin)",
    )
