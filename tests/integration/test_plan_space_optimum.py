"""hetero-plan's search against the exhaustive reference (hetero_llm/planner/exact.py) on a sample of
bench/planner/plan_exhaustive.py's clusters: within the targets on the sample, and the optimum reached on the
clusters it once missed. Each test enumerates a cluster's whole plan space (seconds of CPU each), so in the
integration tier; tests/unit/test_plan_space.py checks the search's moves. Torch-free, one process."""

from __future__ import annotations

import functools
import math

import pytest

from bench.planner import plan_exhaustive
from bench.planner.plan_bench import load
from hetero_llm.planner import moves, plan_cluster, with_optimizer
from hetero_llm.planner.search import Planner
from hetero_llm.planner.structure import Structure

# clusters of bench/planner/plan_exhaustive.py whose spaces are small enough for seconds (3 devices of 3 kinds, 2-3
# domains, memory-tight models); the bench runs 200 of them, of 3, 5 and 7 devices
SAMPLE = [1, 2, 3, 5, 7, 9, 11, 12, 13, 14, 16, 19, 22, 24, 27]


def test_the_sample_meets_the_targets_only_with_every_cluster_within_them():
    """On this sample ">= 95% within 1%" leaves no cluster out (the per-cluster test below asks each for 1%)."""
    assert math.ceil(plan_exhaustive.TARGET_SHARE * len(SAMPLE) - 1e-9) == len(SAMPLE)


@pytest.mark.parametrize("seed", SAMPLE)
def test_search_is_within_the_targets_of_the_exhaustive_optimum(seed):
    """>= 95% of the sample within 1% of the optimum over the whole space (device subsets, every schedule and
    chunk count, both optimizers), none worse than 1.03x: on 15 clusters every one within 1% (above), one cluster
    a test (the sample's clusters run in parallel under pytest-xdist); and the search never beats the reference
    (it is the optimum of the same space)."""
    (row,) = plan_exhaustive.run([seed])
    assert row["ratio"] >= 1 - 1e-9, "the reference missed a plan the search found: it is not exhaustive"
    assert row["ratio"] <= 1 + plan_exhaustive.WITHIN
    assert row["ratio"] <= plan_exhaustive.TARGET_WORST


@functools.cache  # a pure function: the tests that read it plan it once per process
def solved(seed: int):
    """Cluster ``seed`` of bench/planner/plan_exhaustive.py, its reference optimum and the search's result."""
    c = load(plan_exhaustive.draw(seed))
    return c, plan_exhaustive.reference(c)[0], plan_cluster(c)


def test_search_reaches_the_optimum_where_the_tp_group_must_change_node():
    """Cluster 143 of bench/planner/plan_exhaustive.py: the optimum hosts the TP-2 group on the other two-device node
    than the search's earlier local optimum, with the idle device between two nodes' stages (issue 23's worst
    miss, 1.052x): the node-exchange and idle-insertion moves reach it."""
    _, optimum, res = solved(143)
    assert res.score.step_time <= optimum * (1 + 1e-9)


@pytest.mark.parametrize("seed", [36, 151])
def test_search_reaches_an_optimum_of_three_rows_per_microbatch(seed):
    """Clusters 36 and 151 of bench/planner/plan_exhaustive.py (batch 6): the optimum runs microbatches of 3 rows, which
    doubling and halving never reach from 1 or 2 (1.036x and 1.046x before the sweep tried the smallest divisors
    of the batch and the rows move the next divisor above and below)."""
    _, optimum, res = solved(seed)
    assert res.score.step_time <= optimum * (1 + 1e-9)
    assert {p.rows for p in res.best.pipelines} == {3}


@pytest.mark.parametrize("seed", [9, 130])
def test_search_reaches_an_optimum_of_another_schedule_and_microbatch_size(seed):
    """Clusters 9 and 130 of bench/planner/plan_exhaustive.py (the misses once the calibrated constant applied to every
    GPU kind: 1.021x and 1.038x): 9's optimum interleaves 6 microbatches of 1 row where the search stopped at
    ZB-H1 with 3 of 2 (and another stage order); 130's runs the last 2 of the search's 4 interleaved stages with
    4 chunks and 2 rows instead of 2 chunks and 1. Each change alone is worse: the schedule and rows move as one,
    and a pipeline's first or last stages left idle at once, reach them."""
    _, optimum, res = solved(seed)
    assert res.score.step_time <= optimum * (1 + 1e-9)
    assert res.best.schedule == "interleaved"


def test_search_splits_a_tp_group_into_two_pipelines_each_with_an_idle_device():
    """Cluster 196 of bench/planner/plan_exhaustive.py (a miss, 1.040x, once the memory model counted what RMS norm and RoPE
    save): the search stopped at one TP-2 stage on the two A100s; the optimum is two pipelines, an A100 with 7
    layers then an RTX 3090 with 1 each. An A100 alone does not fit 8 layers, and an RTX 3090 added alone does not
    pay: the data-parallel split with an idle group at the end of each copy is one move. Since the memory model
    counts when the gradients exist (issue 33: none during a step's first forwards), the search stops elsewhere, at
    the TP-2 stage with the whole batch in one 1F1B microbatch (which now fits), 1.0007x the optimum; the move is
    checked from where it was found."""
    c, optimum, res = solved(196)
    assert optimum * (1 - 1e-9) <= res.score.step_time <= optimum * 1.001
    pl = Planner(c)
    groups = pl.groups({"a100-40g": 2})
    a100 = next(g for g in groups if g.kind.name == "a100-40g")
    split = [
        [(g.kind.name, g.tp) for g in p]
        for nb in moves.neighbours(pl, Structure(((a100,),), 2, "zbh1"))
        if nb.rows == 2 and len(nb.pipelines) == 2
        for p in nb.pipelines
    ]
    assert [("a100-40g", 1), ("rtx3090", 1)] in split


def test_bound_is_below_every_simulated_step():
    """The search skips a neighbour whose lower bound (each stage's compute after the fill of the stages before
    it, + sync + optimizer) is not below the best so far: it must never exceed the simulated step, under every
    schedule and chunk count the searches of a few clusters scored."""
    checked = 0
    for text in [plan_exhaustive.draw(s) for s in SAMPLE[:2]] + [plan_exhaustive._draw(200)]:
        c = load(text)
        for opt in c.limits.optimizers:
            pl = Planner(with_optimizer(c, opt), max_evals=300)
            pl.run()
            for cand, score in pl.scored.values():
                if score.feasible:
                    assert pl.bound(cand) <= score.step_time * (1 + 1e-12)
                    checked += 1
    assert checked > 300
