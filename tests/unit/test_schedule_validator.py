"""The schedule validator against written rules: generated schedules validate, deadlocks and static errors are
named with the grid, the grid printer, and the order of receives NCCL needs (every schedule receives in the
order sent).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from hetero_llm.errors import ScheduleError
from hetero_llm.schedule import (
    Action,
    Kind,
    build,
    check_message_order,
    compute_schedule,
    format_grid,
    gpipe,
    lower,
    parse_actions,
    simulate_order,
    validate,
)

GRID = list(itertools.product(range(1, 6), range(1, 10)))  # (num_stages, num_microbatches)
KINDS = ["gpipe", "1f1b", "zbh1"]
INTERLEAVED_GRID = [
    (stages, chunks, mbs) for stages in range(2, 5) for chunks in (2, 3) for mbs in range(stages, 9, stages)
]


# --------------------------------------------------------------------------- validator


@pytest.mark.parametrize("num_stages, num_microbatches", GRID)
def test_generated_schedules_validate(num_stages: int, num_microbatches: int) -> None:
    for kind in KINDS:
        check_validates(kind, num_stages, num_microbatches)


def check_validates(kind: str, num_stages: int, num_microbatches: int) -> None:
    validate(compute_schedule(kind, num_stages, num_microbatches), num_microbatches)
    lowered = build(kind, num_stages, num_microbatches)
    validate(lowered, num_microbatches)
    rounds = simulate_order(lowered)
    ran = [event for round_ in rounds for event in round_]
    # Every action runs exactly once, and each stage runs its list in order.
    assert sorted(ran) == [(s, i) for s, actions in enumerate(lowered) for i in range(len(actions))]
    for stage in range(num_stages):
        assert [i for s, i in ran if s == stage] == list(range(len(lowered[stage])))


def test_lockstep_takes_a_round_per_hop() -> None:
    rounds = simulate_order(build("gpipe", 3, 1))
    # stage 0 runs F0 SEND_F0; stage 1 can receive only in the next round, and so on.
    assert rounds[0] == [(0, 0), (0, 1)]
    assert rounds[1] == [(1, 0), (1, 1), (1, 2)]
    assert rounds[2][0] == (2, 0)


def deadlocking() -> list[list[Action]]:
    """Stage 0 waits for the gradient of mb 0 before it has sent mb 0 forward."""
    return [parse_actions("F0 RECV_B0 SEND_F0 B0"), parse_actions("RECV_F0 F0 B0 SEND_B0")]


def test_deadlock_is_reported_with_grid() -> None:
    with pytest.raises(ScheduleError) as info:
        validate(deadlocking(), 1)
    message = str(info.value)
    first = message.splitlines()[0]
    assert first == (
        "deadlock: stage 0 waits at RECV_B0 (step 1) for SEND_B0 on stage 1, which never comes "
        "(stage 1 is stuck at RECV_F0, step 0)"
    )
    assert "<-- ERROR HERE" in message
    assert message.splitlines()[1].split() == ["step", "stage", "0", "stage", "1"]
    # Both stuck stages are marked, at the step each waits at.
    assert message.splitlines()[2].endswith("RECV_F0 <-- ERROR HERE")
    assert "RECV_B0 <-- ERROR HERE" in message.splitlines()[3]
    assert (info.value.stage, info.value.step) == (0, 1)  # located as data: the stage and step the line names
    with pytest.raises(ScheduleError, match="^deadlock: stage 0"):
        simulate_order(deadlocking())


def test_deadlock_in_a_longer_pipeline_names_the_stage() -> None:
    schedule = build("1f1b", 3, 4)
    # Stage 1 receives mb 2 before mb 1: it waits for a SEND_F2 that stage 0 only does later.
    swap = schedule[1].index(Action(Kind.RECV_F, 1)), schedule[1].index(Action(Kind.RECV_F, 2))
    schedule[1][swap[0]], schedule[1][swap[1]] = schedule[1][swap[1]], schedule[1][swap[0]]
    with pytest.raises(ScheduleError) as info:
        validate(schedule, 4)
    assert "needs RECV_F1 first" in str(info.value).splitlines()[0]


def test_deadlock_names_what_the_other_stage_runs() -> None:
    """The input gradient a stage waits for is named as the other stage writes it: B0, or I0."""
    for other, name in (("F0 F1 B0 B1", "B0"), ("F0 F1 I0 I1 W0 W1", "I0")):
        with pytest.raises(ScheduleError) as info:
            validate([parse_actions("F0 I0 W0 F1 I1 W1"), parse_actions(other)], 2)
        assert str(info.value).splitlines()[0] == (
            f"deadlock: stage 0 waits at I0 (step 1) for {name} on stage 1, which never comes "
            "(stage 1 is stuck at F1, step 1)"
        )


def test_missing_backward_is_named() -> None:
    schedule = gpipe(2, 3)
    schedule[1] = [a for a in schedule[1] if a != Action(Kind.B, 1)]
    with pytest.raises(ScheduleError) as info:
        validate(schedule, 3)
    assert str(info.value).splitlines()[0] == (
        "stage 1 is missing B1 (every stage runs F and B (or I and W) exactly once per microbatch 0..2)"
    )
    assert "stage 0" in str(info.value).splitlines()[1]  # the grid follows
    assert (info.value.stage, info.value.step) == (1, None)  # about the stage, no one step


@pytest.mark.parametrize(
    "stages, num_microbatches, location",
    [
        (["F0 B0 F0", "F0 B0"], 1, (0, 2)),  # repeated action
        (["F0 B0", "F0 B0 F1 B1"], 1, (1, 2)),  # microbatch out of range
        (["F0 B0 B1 F1", "F0 B0 F1 B1"], 2, (0, 2)),  # needs a later action
        (["F0 SEND_F0 RECV_B0 B0", "F0 B0 SEND_B0"], 1, (0, 1)),  # unmatched send
        (["F0 I0 B0 W0", "F0 B0"], 1, (0, None)),  # both B and I/W: names no step
        (["F0 I0", "F0 B0"], 1, (0, None)),  # I without W
        (["F0 RECV_B0 SEND_F0 B0", "RECV_F0 F0 B0 SEND_B0"], 1, (0, 1)),  # deadlock
        (["AG0 F0 B0 AG0", "F0 B0"], 1, (0, 3)),  # repeated optimizer action
        (["F0 B0 AG0", "F0 B0"], 1, (0, 2)),  # AG after a forward
    ],
)
def test_validator_errors_carry_their_location(stages: list[str], num_microbatches: int, location) -> None:
    """``stage``/``step`` are set where the error is found, and agree with the stage and step the message names."""
    with pytest.raises(ScheduleError) as info:
        validate([parse_actions(text) for text in stages], num_microbatches)
    assert (info.value.stage, info.value.step) == location
    first = str(info.value).splitlines()[0]
    assert re.match(rf"(deadlock: )?stage {location[0]}\b", first), first
    if location[1] is not None:
        assert re.search(rf"\bsteps? (\d+ and )?{location[1]}\b", first), first


@pytest.mark.parametrize(
    "stages, num_microbatches, error",
    [
        (["F0 F0 B0"], 1, r"^stage 0 runs F0 twice \(steps 0 and 1\)"),
        (["F0 B0 F1 B1"], 1, r"^stage 0 step 2: F1 names microbatch 1, but there are 1 \(0..0\)"),
        (["B0 F0"], 1, r"^stage 0 step 0: B0 needs F0 first, but F0 comes later \(step 1\)"),
        (["RECV_F0 F0 B0"], 1, r"^stage 0 step 0: RECV_F0 talks to stage -1, but stage 0 has no previous"),
        (["F0 SEND_F0 B0", "F0 B0"], 1, r"^stage 0 step 1: SEND_F0 has no matching RECV_F0 on stage 1"),
        (["F0 SEND_F0 RECV_B0 B0", "RECV_F0 F0 B0"], 1, r"^stage 0 step 2: RECV_B0 has no matching SEND_B0 on stage 1"),
        (["F0 SEND_F0 RECV_B0 B0", "RECV_F0 F0 B0 SEND_B0 W0 W0"], 1, r"^stage 1 runs W0 twice"),
        (["F0 I0 W0", "F0 B0"], 1, None),  # a backward is one B, or an I and a W
        (["F0 B0 W0", "F0 B0"], 1, r"^stage 0 runs both B0 and W0 \(a backward is one B, or an I and a W\)"),
        (["F0 I0 B0", "F0 B0"], 1, r"^stage 0 runs both B0 and I0"),
        (["F0 I0", "F0 B0"], 1, r"^stage 0 runs I0 but never W0 \(an input gradient I needs its weight gradient W"),
        (["F0 W0", "F0 B0"], 1, r"^stage 0 is missing B0 \(or I0 and W0\) \(every stage runs"),
        (["F0 W0 I0", "F0 B0"], 1, r"^stage 0 step 1: W0 needs I0 \(or B0\) first, but I0 comes later \(step 2\)"),
        (["F0 SEND_F0 RECV_B0 I0 W0", "RECV_F0 F0 I0 SEND_B0 W0"], 1, None),  # lowered, split on both
        (
            ["F0 SEND_F0 RECV_B0 B0", "RECV_F0 F0 SEND_B0 I0 W0"],
            1,
            r"^stage 1 step 2: SEND_B0 needs I0 \(or B0\) first, but I0 comes later \(step 3\)",
        ),
        (["F0.1 B0.1", "F0.1 B0.1"], 1, r"^stage 0 is missing F0 \(.* and chunk 0..1\)"),
    ],
)
def test_static_errors(stages: list[str], num_microbatches: int, error: str | None) -> None:
    schedule = [parse_actions(text) for text in stages]
    if error is None:
        validate(schedule, num_microbatches)
        return
    with pytest.raises(ScheduleError, match=error):
        validate(schedule, num_microbatches)


def test_validate_rejects_bad_inputs() -> None:
    with pytest.raises(ScheduleError, match="no stages"):
        validate([], 1)
    with pytest.raises(ScheduleError, match="num_microbatches must be >= 1"):
        validate(gpipe(1, 1), 0)
    with pytest.raises(ScheduleError, match=r"stage 0 step 0: 'F0' is not an Action"):
        validate([["F0"]], 1)  # type: ignore[list-item]


# --------------------------------------------------------------------------- grid


def test_format_grid_layout_and_mark() -> None:
    schedule = [parse_actions("F0 SEND_F0 RECV_B0 B0"), parse_actions("RECV_F0 F0 B0 SEND_B0")]
    assert format_grid(schedule).splitlines() == [
        "step  stage 0  stage 1",
        "   0  F0       RECV_F0",
        "   1  SEND_F0  F0",
        "   2  RECV_B0  B0",
        "   3  B0       SEND_B0",
    ]
    marked = format_grid(schedule, mark={0: 2}).splitlines()
    assert marked[3] == "   2  RECV_B0 <-- ERROR HERE  B0"
    # The column after the mark stays aligned with its header.
    assert marked[0].index("stage 1") == marked[3].rindex("B0")


def test_format_grid_uneven_stages_and_wide_row_labels() -> None:
    schedule = [[Action(Kind.F, m) for m in range(12)], [Action(Kind.B, 0)]]
    lines = format_grid(schedule).splitlines()
    assert len(lines) == 13
    assert lines[1] == "   0  F0       B0"
    assert lines[12] == "  11  F11"


# --------------------------------------------------------------------------- message order (NCCL)


@pytest.mark.parametrize("num_stages, num_microbatches", GRID)
def test_generated_schedules_receive_in_the_order_sent(num_stages: int, num_microbatches: int) -> None:
    for kind in KINDS:
        check_message_order(build(kind, num_stages, num_microbatches))


@pytest.mark.parametrize("num_stages, chunks, num_microbatches", INTERLEAVED_GRID)
def test_interleaved_receives_in_the_order_sent(num_stages: int, chunks: int, num_microbatches: int) -> None:
    check_message_order(build("interleaved", num_stages, num_microbatches, chunks=chunks))


def test_out_of_order_receive_is_named_with_both_ends_marked() -> None:
    """Valid for gloo (tags match), wrong for NCCL: stage 1 takes microbatch 1 first, stage 0 sends 0 first."""
    schedule = lower([parse_actions("F0 F1 B0 B1"), parse_actions("F1 F0 B0 B1")])
    validate(schedule, 2)
    with pytest.raises(ScheduleError) as info:
        check_message_order(schedule)
    lines = str(info.value).splitlines()
    assert lines[0] == (
        "stage 1 step 0: RECV_F1 receives out of order: stage 0 sends SEND_F0 (step 1) first, "
        "and NCCL matches messages by order (receive in the order sent, or use backend = 'gloo')"
    )
    assert lines[2].endswith("RECV_F1 <-- ERROR HERE") and "SEND_F0 <-- ERROR HERE" in lines[3]


def test_nccl_layout_refuses_a_schedule_file_received_out_of_order(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hetero_llm.cli.launch import main

    (tmp_path / "order.txt").write_text("F0 F1 B0 B1\nF1 F0 B0 B1\n")
    layout = tmp_path / "layout.toml"
    layout.write_text("""
[model]
layers = 2
hidden = 32
heads = 4
vocab = 64
seq_len = 16
[train]
steps = 1
global_batch = 4
[cluster]
backend = "nccl"
[[cluster.nodes]]
name = "gpu0"
devices = ["cuda:0", "cuda:1"]
[[pipelines]]
batch = 4
microbatches = 2
schedule_file = "order.txt"
[[pipelines.stages]]
layers = 1
devices = ["gpu0:0"]
[[pipelines.stages]]
layers = 1
devices = ["gpu0:1"]
""")
    result = CliRunner().invoke(main, [str(layout), "--dry-run"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        f"error: {layout}: pipelines[0].schedule_file: order.txt: stage 1 step 0: RECV_F1 receives out of order: "
        "stage 0 sends SEND_F0 (step 1) first, and NCCL matches messages by order (receive in the order sent, or "
        "use backend = 'gloo')"
    )
    gloo = CliRunner().invoke(main, [str(layout), "--dry-run", "--set", "cluster.backend=gloo"])
    assert gloo.exit_code == 0, gloo.output  # gloo matches by tag: the same file runs there
