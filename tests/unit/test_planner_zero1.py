"""The planner under ZeRO-1: each device's moments are the optimizer's slices (plan.zero1_slices), and ZeRO-1 fits
plans plain AdamW cannot. Torch-free.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_planner import small_cluster

from harness import LAYOUTS
from hetero_llm import layout as layout_mod
from hetero_llm.planner import plan_cluster
from hetero_llm.planner.cluster import load_cluster
from hetero_llm.planner.cost import PlannerCostModel
from hetero_llm.planner.output import layout_text
from hetero_llm.planner.search import Planner, Structure

SMALL = LAYOUTS / "clusters" / "small_cpu.toml"


def zero1_cluster(tmp_path: Path, memory: dict[str, float]) -> Path:
    def edit(text: str) -> str:
        text = text.replace("log_every = 1\n", 'log_every = 1\noptimizer = "adamw_zero1"\n')
        text = text.replace("[plan]\n", '[plan]\noptimizers = ["adamw_zero1"]\n')
        for node, gb in memory.items():
            text = text.replace(f'name = "{node}"\n', f'name = "{node}"\nmemory_gb = {gb}\n')
        return text

    return small_cluster(tmp_path, edit=edit)


@pytest.mark.parametrize("memory", [{}, {"fast0": 6, "slow0": 2, "slow1": 4}, {"fast0": 6}])
def test_zero1_moments_are_optim_shards_slices(tmp_path, memory):
    """The planner's ZeRO-1 state per device is what plan.zero1_slices gives the written layout's ranks (up to
    whole rows), for every plan it ranks: TP 2 beside TP 1, uneven boundaries, memory_gb weights declared
    on every node, on some (then unweighted) or none."""
    from hetero_llm.plan import compile_plan, zero1_slices

    path = zero1_cluster(tmp_path, memory)
    c = load_cluster(path)
    cost = PlannerCostModel(c)
    plain = PlannerCostModel(load_cluster(SMALL))
    result = plan_cluster(c, top=12)
    multi = 0
    for cand, _ in result.ranked:
        plan = compile_plan(layout_mod.loads(layout_text(c, cand, cost.score(cand), None), base_dir=path.parent))
        rank, total = 0, 0.0
        for pipe, moments, whole in zip(cand.pipelines, cost.moments(cand), plain.moments(cand)):
            for stage, m, w in zip(pipe.stages, moments, whole):
                for _ in stage.group.devices:
                    got = zero1_slices.state_elements(plan, rank, zero1=True)
                    assert m == pytest.approx(got, rel=0.03, abs=64), (cand, rank)
                    assert m <= w * (1 + 1e-9)
                    rank, total = rank + 1, total + m
        multi += len(cand.pipelines) > 1
        assert total == pytest.approx(cost.stage_full_params(8, True, True))  # every element's state once
    assert multi >= 3


def test_zero1_lets_a_plan_fit_that_plain_adamw_cannot(tmp_path):
    """With the state split over the holders, two data-parallel pipelines fit where each alone held too much;
    the DP's memory bound is never below the realized plan's memory."""
    shrink = lambda t: t.replace("memory_gb = 8", "memory_gb = 0.0022")  # noqa: E731
    plain = Planner(load_cluster(small_cluster(tmp_path, edit=shrink)))
    c = load_cluster(
        small_cluster(
            tmp_path, edit=lambda t: shrink(t).replace("log_every = 1\n", 'log_every = 1\noptimizer = "adamw_zero1"\n')
        )
    )
    zero = Planner(c)
    groups = zero.groups({"cpu2x": 1, "cpu": 1})
    st = Structure(((groups[0],), (groups[1],)), 1)
    assert plain.realize(st) is None
    cand = zero.realize(st)
    assert cand is not None and len(cand.pipelines) == 2
    assert zero.evaluate(cand).feasible
    others = zero.zero1_others(st)
    for pipe, moments, other in zip(cand.pipelines, zero.cost.moments(cand), others):
        s = pipe.stages[0]
        assert zero.cost.moment_elements(s.group, s.layers, True, True, other) >= moments[0] * (1 - 1e-12)
    assert zero.cost.optimizer_time(cand) == pytest.approx(plain.cost.optimizer_time(cand) / 2, rel=0.01)
