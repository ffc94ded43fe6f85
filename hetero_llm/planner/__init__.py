"""``hetero-plan``: search the layouts a cluster can run for the fastest one under a cost model. Torch-free.

Modules, in data-flow order: ``cluster`` (the cluster file and ``[plan]``; device kinds in ``catalogue``, the
corpus in ``documents``, measured profiles in ``profile``), ``candidates`` (a candidate layout and its score),
``cost`` (step time of a candidate: per-operation pricing in ``roofline``, context parallelism in ``context``,
the pipeline simulation in ``pipesim``, memory in ``memory`` and ``spans``), ``search`` (the search: its
structures in ``structure``, the sweep in ``sweep``, the exact layer split and batch split in ``layers`` and
``shares``, local-search moves in ``moves``, seeds from ``place``'s Holmes placement in ``seeds``; the exhaustive
reference ``exact``), ``buckets`` (bucket layouts for hot switching), ``evaluate`` (``--evaluate``: a given
layout priced), ``output`` (the layout file and the explanation). ``plan_cluster`` searches a cluster (what
``api.plan_cluster`` and ``hetero-plan`` call); ``plan_file`` loads a cluster file and plans it.
"""

from __future__ import annotations

import os
import time

import attrs

from hetero_llm.layout import Optimizer
from hetero_llm.planner.candidates import Candidate, Score
from hetero_llm.planner.cluster import Cluster, load_cluster
from hetero_llm.planner.search import Planner, Result
from hetero_llm.planner.seeds import place_seeds
from hetero_llm.progress import Bar

__all__ = ["load_cluster", "place_seeds", "plan_cluster", "plan_file", "planned_cluster"]


def plan_cluster(cluster: Cluster, top: int = 5, budget_s: float | None = None, progress: bool = False) -> Result:
    """The search's result for ``cluster``; ``progress``: show the plans simulated (of the work budget) and the
    best predicted step so far on a terminal.

    Each optimizer of ``plan.optimizers`` is searched, within one work budget (``plan.max_evals``) shared equally:
    the cluster file's train.optimizer first (with what the others leave), with the sweep; each other one without,
    starting from the first search's best plans and hetero-place's (on HexiScale's cluster the ZeRO-1 search needs
    its half to descend from there to the best plan: docs/planner.md). The fastest plan of all wins; its
    ``optimizer`` is the train.optimizer to write."""
    options = optimizer_order(cluster)
    total = Planner(with_optimizer(cluster, options[0]), budget_s=budget_s).max_evals  # plan.max_evals, for all
    evals = [max(1, total // len(options))] * (len(options) - 1)  # each other optimizer: an equal share
    evals.insert(0, max(1, total - sum(evals)))
    results: list[Result] = []
    with Bar("planning", sum(evals), "plans", enabled=None if progress else False) as bar:
        cap = cluster.limits.time_budget_s if budget_s is None else budget_s
        start = time.perf_counter()
        for opt, n in zip(options, evals):
            # the plan.time_budget_s safety net spans every search: each gets what the earlier ones left
            left = max(1e-3, cap - (time.perf_counter() - start)) if cap > 0 else 0.0
            planner = Planner(with_optimizer(cluster, opt), budget_s=left, max_evals=n)
            planner.progress = bar
            planner.best_so_far = min((r.score.step_time for r in results), default=planner.best_so_far)
            seeds = place_seeds(planner.cluster) + [c for r in results for c, _ in r.ranked]
            # the first search sweeps; the others start from its best plans (and hetero-place's)
            res = planner.run(seeds, top=max(top, 8) if len(options) > 1 else top, swept=not results)
            results.append(tag(res, opt))
        bar.total = bar.done or bar.total  # the search ended (its budget spent or no move left): shown as done
        bar.update(0, note=f"best {min(r.score.step_time for r in results):.4g} s")
    return merge(results, top) if len(results) > 1 else results[0]


def optimizer_order(cluster: Cluster) -> list[str]:
    """``plan.optimizers``, the cluster file's train.optimizer first when it is one of them."""
    own = cluster.train.optimizer.value
    return sorted(cluster.limits.optimizers, key=lambda o: o != own)


def with_optimizer(cluster: Cluster, optimizer: str) -> Cluster:
    """The cluster with train.optimizer = ``optimizer`` (what the cost model's memory and optimizer step read)."""
    if cluster.train.optimizer.value == optimizer:
        return cluster
    return attrs.evolve(cluster, train=attrs.evolve(cluster.train, optimizer=Optimizer(optimizer)))


def planned_cluster(cluster: Cluster, cand: Candidate) -> Cluster:
    """The cluster as the plan runs it: with the plan's train.optimizer."""
    return with_optimizer(cluster, cand.optimizer) if cand.optimizer else cluster


def tag(res: Result, optimizer: str) -> Result:
    def t(c: Candidate) -> Candidate:
        return attrs.evolve(c, optimizer=optimizer)

    return attrs.evolve(res, best=t(res.best), ranked=tuple((t(c), s) for c, s in res.ranked))


def merge(results: list[Result], top: int) -> Result:
    """The searches of several optimizers as one result: the fastest plans of all (ties: the earlier search's)."""
    ranked = sorted(
        ((c, s, i) for i, r in enumerate(results) for c, s in r.ranked), key=lambda x: (x[1].step_time, x[2])
    )
    distinct: list[tuple[Candidate, Score]] = []
    shapes: set[tuple] = set()
    for c, s, _ in ranked:  # a plan under each optimizer: once, under the faster
        if c.shape() not in shapes and len(distinct) < max(1, top):
            shapes.add(c.shape())
            distinct.append((c, s))
    first = results[0]
    return Result(
        ranked[0][0],
        ranked[0][1],
        tuple(distinct),
        sum(r.evaluated for r in results),
        sum(r.seconds for r in results),
        first.seed_score,
        any(r.cut_by_time for r in results),
    )


def plan_file(
    path: str | os.PathLike, top: int = 5, profile_file: str | os.PathLike | None = None
) -> tuple[Cluster, Result]:
    cluster = load_cluster(path, profile_file)
    result = plan_cluster(cluster, top)
    return planned_cluster(cluster, result.best), result
