"""ZeRO-1 (``train.optimizer = 'adamw_zero1'``): the sharded optimizer trains the same model as one process.

Pure checks first (which rank updates which slice, the memory formula, the schedule actions and the
simulator), then whole runs through ``hetero-launch`` (gloo, CPU) against the single-process run with
gradient clipping active (``train.grad_clip`` below every step's norm), checkpoints saved under ZeRO-1
and resumed without it on another layout and the reverse, bf16, and the trace's RS/AG actions.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from harness import LAYOUTS, assert_one_error_line, common_sections, invoke_cli, write_layout
from hetero_llm import layout as layout_mod
from hetero_llm import schedule as sched
from hetero_llm.errors import ScheduleError
from hetero_llm.model.params import all_params
from hetero_llm.plan import compile_plan, zero1_slices
from hetero_llm.predict.simulate import CostModel, simulate

REFERENCE = LAYOUTS / "reference" / "reference.toml"

COMMON = common_sections(REFERENCE)  # 6 layers, hidden 32, 4 heads, global batch 12


def _zero1(common: str) -> str:
    return common.replace('schedule = "1f1b"', 'schedule = "1f1b"\noptimizer = "adamw_zero1"')


def _plan(tmp_path: Path, pipelines, common: str = COMMON, memory: list[float] | None = None):
    path = write_layout(tmp_path / "layout.toml", _zero1(common), pipelines)
    if memory:
        text = path.read_text()
        for i, gb in enumerate(memory):
            text = text.replace(f'name = "n{i}"\n', f'name = "n{i}"\nmemory_gb = {gb}\n')
        path.write_text(text)
    return compile_plan(layout_mod.load(path))


SLICE_CASES = {
    "2 pipelines tp 1 / 1": [(6, 2, [(6, 1)]), (6, 2, [(3, 1), (3, 1)])],
    "tp 2 beside tp 1": [(8, 4, [(3, 1), (3, 2)]), (4, 2, [(6, 1)])],
    "3 pipelines": [(6, 2, [(6, 1)]), (4, 2, [(3, 1), (3, 2)]), (2, 1, [(6, 4)])],
    "1 pipeline tp 2 (replicated tensors only)": [(12, 3, [(2, 1), (4, 2)])],
}


@pytest.mark.parametrize("pipelines", SLICE_CASES.values(), ids=SLICE_CASES.keys())
def test_every_element_is_updated_by_exactly_one_rank(pipelines, tmp_path):
    plan = _plan(tmp_path, pipelines)
    count = {p.name: [0] * p.shape[p.shard_dim or 0] for p in all_params(plan.layout.model)}  # rows along the dim
    for rank in range(plan.world_size):
        held = {info.name: (lo, hi) for info, lo, hi in plan.params_of(rank)}
        mine, rest = zero1_slices.owned(plan, rank)
        for name, _dim, lo, hi in [s for _, sl in mine for s in sl] + rest:
            assert held[name][0] <= lo <= hi <= held[name][1], f"rank {rank} updates {name} rows it does not hold"
            for row in range(lo, hi):
                count[name][row] += 1
    wrong = {n: c for n, c in count.items() if any(x != 1 for x in c)}
    assert not wrong, wrong


def test_state_per_rank_reduced_by_the_documented_factor(tmp_path):
    """TP 2 beside TP 1 on the same 3 layers: each layer's state is split over the 3 devices that hold it
    (weights tp: 1 and 2 + ... see docs/zero1.md), so the TP-1 rank keeps 1/3 of its state and each TP-2 rank
    2/3 of its (half-size) state, for the matrices; the replicated norms split 1 : 1 : 1."""
    plan = _plan(tmp_path, [(6, 2, [(3, 1), (3, 2)]), (6, 2, [(3, 1), (3, 1)])])
    full = {r: zero1_slices.state_elements(plan, r, zero1=False) for r in range(plan.world_size)}
    zero = {r: zero1_slices.state_elements(plan, r, zero1=True) for r in range(plan.world_size)}
    # ranks: 0 = p0.s0, 1-2 = p0.s1 (tp 2), 3 = p1.s0, 4 = p1.s1: stage 0 is held by 2 ranks of tp 1
    assert zero[0] + zero[3] == full[0] == full[3]
    assert abs(zero[0] - zero[3]) <= full[0] // 100  # split evenly
    # stage 1 (layers 3-5 and the head) is held by 3 devices: about a third each
    for r in (1, 2, 4):
        assert abs(zero[r] - full[4] / 3) <= full[4] * 0.05, (r, zero[r], full[4])
    assert sum(zero.values()) == sum(full[r] for r in (0, 4))  # each element's state exactly once


def test_dry_run_shows_the_state_per_rank(tmp_path):
    path = write_layout(tmp_path / "layout.toml", COMMON, [(6, 2, [(6, 1)]), (6, 2, [(6, 1)])])
    plain = invoke_cli(path, "--dry-run")
    zero = invoke_cli(path, "--dry-run", "--full", "--set", "train.optimizer=adamw_zero1")
    assert plain.exit_code == 0 and zero.exit_code == 0, zero.output
    assert "optimizer state per rank" not in plain.stdout
    table = zero.stdout.split("optimizer state per rank")[1].splitlines()[2:]
    assert [row.split()[-1] for row in table] == ["2.00", "2.00"]  # two identical pipelines halve it
    assert "AG0" in zero.stdout and "RS0" in zero.stdout and "AG0" not in plain.stdout


def test_memory_gb_weights_the_slices(tmp_path):
    plan = _plan(tmp_path, [(6, 2, [(6, 1)]), (6, 2, [(6, 1)])], memory=[16, 48])
    small, big = (zero1_slices.state_elements(plan, r, zero1=True) for r in (0, 1))
    assert abs(big / small - 3) < 0.05


def test_optimizer_actions_frame_every_stage_and_round_trip(tmp_path):
    plan = _plan(tmp_path, [(12, 3, [(2, 1), (4, 1)])])
    for actions in plan.schedules[0]:
        kinds = [a.kind for a in actions]
        assert kinds[-1] is sched.Kind.RS
        assert kinds.index(sched.Kind.AG) == kinds.index(sched.Kind.F) - 1  # right before the first forward
    text = sched.format_actions(plan.schedules[0][1])
    assert text.startswith("RECV_F0 AG0 F0") and text.endswith("RS0")
    assert sched.format_actions(sched.parse_actions(text)) == text


def _with_schedule_file(tmp_path: Path, order: str) -> Path:
    """A 2-stage ZeRO-1 layout whose schedule is ``order`` (a schedule file's text)."""
    (tmp_path / "order.txt").write_text(order)
    path = write_layout(tmp_path / "layout.toml", _zero1(COMMON), [(12, 2, [(3, 1), (3, 1)])])
    path.write_text(path.read_text().replace("microbatches = 2\n", 'microbatches = 2\nschedule_file = "order.txt"\n'))
    return path


def test_a_schedule_file_may_place_the_optimizer_actions(tmp_path):
    """A user's file with its own RS0 early (after its last B, before a trailing send) gets only the AG0 it lacks."""
    path = _with_schedule_file(
        tmp_path,
        "F0 F1 SEND_F0 SEND_F1 RECV_B0 B0 RECV_B1 B1 RS0\nAG0 RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 RS0 SEND_B1\n",
    )
    stage0, stage1 = compile_plan(layout_mod.load(path)).schedules[0]
    assert sched.format_actions(stage0) == "AG0 F0 F1 SEND_F0 SEND_F1 RECV_B0 B0 RECV_B1 B1 RS0"
    assert sched.format_actions(stage1) == "AG0 RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 RS0 SEND_B1"


def test_a_schedule_file_with_a_misplaced_all_gather_wait_is_one_error_line(tmp_path):
    path = _with_schedule_file(
        tmp_path, "# stage 0: the all-gather wait after a forward\nF0 AG0 F1 B0 B1\nF0 B0 F1 B1\n"
    )
    assert_one_error_line(
        invoke_cli(path, "--dry-run"),
        f"{path}: pipelines[0].schedule_file: {tmp_path / 'order.txt'}: line 2: stage 0 step 1: "
        "AG0 must come before the stage's first forward (F0 is on the wrong side)",
    )


def test_misplaced_optimizer_actions_are_refused():
    lowered = sched.build("1f1b", 2, 2)
    bad = [lowered[0][:1] + [sched.Action(sched.Kind.AG, 0)] + lowered[0][1:], lowered[1]]
    with pytest.raises(
        ScheduleError,
        match=r"^stage 0 step 1: AG0 must come before the stage's first forward "
        r"\(F0 is on the wrong side\)",
    ):
        sched.validate(bad, 2)
    with pytest.raises(ScheduleError, match=r"^stage 1 step 0: RS1: RS is once per step, written RS0"):
        sched.validate([lowered[0], [sched.Action(sched.Kind.RS, 1)] + lowered[1]], 2)


def test_simulator_overlaps_the_all_gather_with_the_pipeline_fill():
    """Stage 1's gather is done before its first forward needs it (it waits for stage 0's anyway): only
    stage 0's gather and the last reduce-scatter lengthen the step."""
    schedule = sched.add_optimizer_actions(sched.build("1f1b", 2, 4))
    base = simulate(sched.build("1f1b", 2, 4), CostModel.uniform(2, 1.0, 2.0))
    cost = attrs.evolve(CostModel.uniform(2, 1.0, 2.0), all_gather=(0.5, 0.5), reduce_scatter=(0.25, 0.25))
    result = simulate(schedule, cost)
    assert result.step_time == pytest.approx(base.step_time + 0.5 + 0.25)
    first_f = {
        stage: next(t for t in row if t.action.kind is sched.Kind.F) for stage, row in enumerate(result.timeline)
    }
    assert first_f[0].start == pytest.approx(0.5) and first_f[1].start == pytest.approx(1.5)  # no wait on stage 1
    rs = [next(t for t in row if t.action.kind is sched.Kind.RS) for row in result.timeline]
    assert rs[1].end < rs[0].end  # stage 1 finishes first: its reduce-scatter overlaps stage 0's last backward
