"""What the search moves over: a *structure* (which TP groups form which pipeline, rows per microbatch,
schedule), the search's result, and the few facts of the search the move and enumeration modules read
(``SearchSpace``). Torch-free."""

from __future__ import annotations

from typing import Protocol

import attrs

from hetero_llm.planner.candidates import Candidate, Score, TPGroup
from hetero_llm.planner.cluster import Cluster
from hetero_llm.planner.cost import PlannerCostModel


class SearchSpace(Protocol):
    """What ``moves``, ``exact`` and ``sweep`` need of the search (``search.Planner`` is one)."""

    cluster: Cluster
    cost: PlannerCostModel
    global_batch: int
    domain_order: dict[str, int]
    node_order: dict[str, int]
    start: float
    budget: float
    sweep_limit: int  # structures the sweep may realize (the budget in work)

    @property
    def limits(self): ...  # the cluster's [plan] limits (schedules, max_tp, ...)

    def tp_sizes(self, devices: int) -> list[int]: ...

    def cp_sizes(self, devices: int) -> list[int]: ...

    def group_sizes(self, devices: int) -> list[int]: ...

    def reshape(self, g: TPGroup, cp: int) -> TPGroup: ...

    def groups(self, tp_by_kind: dict[str, int]) -> list[TPGroup]: ...

    def order(self, groups) -> tuple[TPGroup, ...]: ...

    def realize(self, st: Structure) -> Candidate | None: ...

    def estimate(self, cand: Candidate, cutoff: float = ...) -> float: ...

    def out_of_time(self, fraction: float = 0.98) -> bool: ...


@attrs.frozen
class Structure:
    pipelines: tuple[tuple[TPGroup, ...], ...]  # ordered stages (TP groups) of each pipeline
    rows: int  # sequences per microbatch
    schedule: str = "1f1b"
    chunks: int = 2  # model chunks per stage under 'interleaved' (ignored by the other schedules)

    def key(self) -> tuple:
        return (self.rows, self.schedule, self.n_chunks, tuple(tuple(g.name for g in p) for p in self.pipelines))

    @property
    def n_chunks(self) -> int:
        """The candidate's chunks: ``chunks`` under 'interleaved', 1 otherwise."""
        return self.chunks if self.schedule == "interleaved" else 1


@attrs.frozen
class Result:
    best: Candidate
    score: Score
    ranked: tuple[tuple[Candidate, Score], ...]  # the best distinct candidates, best first
    evaluated: int
    seconds: float
    seed_score: Score | None  # hetero-place's plan, when it applies
    cut_by_time: bool = False  # the wall-clock cap (plan.time_budget_s) stopped the search before its work budget
