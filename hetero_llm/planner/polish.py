"""The last step of the search and of its exhaustive reference: the best plans' layer splits polished against the
cost model's own step. Torch-free, deterministic.

The layer DP (``layers.py``) picks each pipeline's split from its front by a closed form (``fill + (m - 1)
slowest``) confirmed by the simulator; the simulated step also pays what that form leaves out (the 1F1B warm-up
that does not fill when a late stage is the slow one, the stage-boundary transfers and their rendezvous waits,
ZB-H1's weight passes) and the gradient sync and optimizer step depend on where the boundaries fall. So the best
candidates are polished: pipeline by pipeline (pipelines of the same stages, kinds and layers at once, so a
cluster of equal pipelines moves them together), every contiguous split of its layers where there are at most
``EVERY_SPLIT``, else every split one unit moved from one stage to another away, each stage recomputing only
where it does not fit otherwise (the DP's rule), its microbatches as planned; each scored by ``Planner.evaluate``
(the cost model's step, memory included) and kept where the step is shorter, until none is (or ``MAX_SCORES``
candidates are scored, at most ``SCORED_DEVICES`` / devices on big clusters: the budget in work, so the plan stays
a function of its input).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import attrs

from hetero_llm.planner.candidates import Candidate, Score
from hetero_llm.planner.structure import Structure

# The search's ``Planner`` (planner/search.py), which calls this module: named as Any here, so that no import circle
# (search -> polish -> search) is made for a type.
Planner = Any

EVERY_SPLIT = 2_000  # a pipeline with more contiguous splits than this tries one-unit moves between its stages
MAX_SCORES = 4_000  # candidates one polish may score, and fewer on big clusters (a score costs ~ devices):
SCORED_DEVICES = 200_000  # at most this / devices (1,024 GPUs: 195, ~15 s of CPU; 40 GPUs: 4,000)


def polish_best(pl: Planner, count: int) -> None:
    """Polish the ``count`` best feasible candidates ``pl`` has scored (their polished splits are scored into
    ``pl.scored``, so the ranking sees them)."""
    ranked = sorted(pl.scored.values(), key=lambda cs: (cs[1].step_time, cs[0].key()))
    for cand, score in [cs for cs in ranked if cs[1].feasible][:count]:
        polish(pl, cand, score)


def polish(pl: Planner, cand: Candidate, score: Score) -> tuple[Candidate, Score]:
    """``cand`` with its pipelines' layer splits descended as the module says, and its score."""
    scored, most = 0, min(MAX_SCORES, max(100, SCORED_DEVICES // max(1, pl.cluster.num_devices)))
    improved = True
    while improved and scored < most and not pl.out_of_time():
        improved = False
        for members in _alike(pl, cand):
            best = None
            for layers, flags in _splits(pl, cand, members[0]):
                pipes = list(cand.pipelines)
                for i in members:
                    groups = tuple(s.group for s in pipes[i].stages)
                    pipes[i] = attrs.evolve(pipes[i], stages=pl.stage_tuple(groups, layers, flags))
                other = attrs.evolve(cand, pipelines=tuple(pipes))
                got = pl.evaluate(other)
                scored += 1
                if got.feasible and got.step_time < score.step_time * (1 - 1e-12):
                    best, score = other, got
                if scored >= most:
                    break
            if best is not None:
                cand, improved = best, True
    return cand, score


def _alike(pl: Planner, cand: Candidate) -> list[list[int]]:
    """The pipelines' indices, those of the same stages (kinds, TP x CP sizes, layers) and microbatches together."""
    out: dict[tuple, list[int]] = {}
    for i, p in enumerate(cand.pipelines):
        key = (p.rows, p.microbatches, tuple((pl._rep_key(s.group), s.layers) for s in p.stages))
        out.setdefault(key, []).append(i)
    return list(out.values())


def _splits(pl: Planner, cand: Candidate, i: int):
    """Pipeline ``i`` with every other contiguous layer split (or every one-unit move), the DP's recompute rule."""
    pipe = cand.pipelines[i]
    k = len(pipe.stages)
    schedule, chunks = (cand.schedule, cand.chunks) if k > 1 or cand.schedule != "interleaved" else ("1f1b", 1)
    unit = chunks if schedule == "interleaved" else 1
    n = pl.L // unit
    peaks = pl.cost._peaks(schedule, k, pipe.microbatches, chunks)
    st = Structure(tuple(tuple(s.group for s in p.stages) for p in cand.pipelines), pipe.rows, cand.schedule)
    others = pl.zero1_others(st)[i]
    now = [s.layers for s in pipe.stages]
    if math.comb(n - 1, k - 1) <= EVERY_SPLIT:
        every = (
            [(b - a) * unit for a, b in zip((0,) + cuts, cuts + (n,))]
            for cuts in itertools.combinations(range(1, n), k - 1)
        )
    else:
        every = (
            [x + unit * ((j == b) - (j == a)) for j, x in enumerate(now)]
            for a in range(k)
            for b in range(k)
            if a != b and now[a] > unit
        )
    groups = tuple(s.group for s in pipe.stages)
    for parts in every:  # (layers, recompute flags) per stage
        if parts == now:
            continue
        flags = []
        for j, (g, layers) in enumerate(zip(groups, parts)):
            t, rc = pl.stage_cost(g, layers, j == 0, j == k - 1, pipe.rows, peaks[j], others)
            if t == math.inf:
                break
            flags.append(rc)
        else:
            yield tuple(parts), tuple(flags)
