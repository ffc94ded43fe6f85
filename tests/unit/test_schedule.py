"""Schedule IR, generators, lowering, validator and schedule files against written rules.

Generators are checked over a grid of (stages 1..5, microbatches 1..9); interleaved 1F1B over
(stages 2..4, chunks 2..3, microbatches the multiples of stages up to 8).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from hetero_llm.errors import ScheduleError
from hetero_llm.schedule import (
    COMM_KINDS,
    Action,
    Direction,
    Kind,
    build,
    check_message_order,
    compute_schedule,
    format_actions,
    format_grid,
    gpipe,
    interleaved_1f1b,
    load_schedule_file,
    lower,
    num_chunks,
    one_f_one_b,
    parse_actions,
    peer,
    requirements,
    simulate_order,
    validate,
    zero_bubble_h1,
)

GRID = list(itertools.product(range(1, 6), range(1, 10)))  # (num_stages, num_microbatches)
KINDS = ["gpipe", "1f1b", "zbh1"]


# --------------------------------------------------------------------------- IR


@pytest.mark.parametrize("kind", list(Kind))
def test_action_str_parse_round_trip(kind: Kind) -> None:
    for mb, chunk in [(0, 0), (3, 0), (12, 0), (0, 1), (7, 2), (10, 11)]:
        action = Action(kind, mb, chunk)
        text = str(action)
        assert text == f"{kind.value}{mb}" + (f".{chunk}" if chunk else "")
        assert Action.parse(text) == action
        assert eval(repr(action)) == action


def test_action_examples() -> None:
    assert str(Action(Kind.F, 3)) == "F3"
    assert str(Action(Kind.SEND_B, 0, 2)) == "SEND_B0.2"
    assert Action.parse("F3.1") == Action(Kind.F, 3, 1)
    assert Kind.SEND_F.value == "SEND_F"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "F",
        "3F",
        "X3",
        "f3",
        "F-1",
        "F3.",
        "F3.x",
        "SEND3",
        "SEND_X3",
        "F3 B3",
        "F03",
        "F3.0",
        "F3.01",
        "RECV_F",
        "W1.2.3",
    ],
)
def test_action_parse_rejects_garbage(text: str) -> None:
    with pytest.raises(ScheduleError, match=r"bad action .*expected KIND MB\[\.CHUNK\]"):
        Action.parse(text)


def test_action_rejects_negative_numbers() -> None:
    with pytest.raises(ValueError):
        Action(Kind.F, -1)
    with pytest.raises(ValueError):
        Action(Kind.F, 0, -1)


def test_format_and_parse_actions() -> None:
    actions = [Action(Kind.F, 0), Action(Kind.SEND_F, 0, 1), Action(Kind.RECV_B, 2), Action(Kind.W, 9)]
    assert format_actions(actions) == "F0 SEND_F0.1 RECV_B2 W9"
    assert parse_actions(format_actions(actions)) == actions
    assert parse_actions("  F0\n B0 ") == [Action(Kind.F, 0), Action(Kind.B, 0)]
    assert parse_actions("") == []
    with pytest.raises(ScheduleError, match=r"^action 2: bad action 'Q1'"):
        parse_actions("F0 B0 Q1")


def test_one_direction_encoding() -> None:
    """Communication kinds know their direction, and each direction its send and receive kinds."""
    assert {kind: kind.direction for kind in COMM_KINDS} == {
        Kind.SEND_F: Direction.FWD,
        Kind.RECV_F: Direction.FWD,
        Kind.SEND_B: Direction.BWD,
        Kind.RECV_B: Direction.BWD,
    }
    assert all(kind.direction is None for kind in Kind if kind not in COMM_KINDS)
    for direction in Direction:
        assert direction.send.direction is direction and direction.recv.direction is direction
    assert [(int(d), d.label) for d in Direction] == [(0, "fwd"), (1, "bwd")]  # message tags, group names


# --------------------------------------------------------------------------- generators


def in_flight_peak(actions: list[Action]) -> int:
    """Most microbatches whose forward has run and backward has not: the activation memory bound."""
    live = peak = 0
    for action in actions:
        live += {Kind.F: 1, Kind.B: -1}.get(action.kind, 0)
        peak = max(peak, live)
    return peak


def one_f_one_b_closed_form(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """Positions written out: with w = min(S - s - 1, M) warmup forwards,
    F m sits at m (m < w) else 2m - w; B m sits at w + 2m + 1 (m < M - w) else M + m."""
    m_total = num_microbatches
    w = min(num_stages - stage - 1, m_total)
    slots: list[Action | None] = [None] * (2 * m_total)
    for m in range(m_total):
        slots[m if m < w else 2 * m - w] = Action(Kind.F, m)
        slots[w + 2 * m + 1 if m < m_total - w else m_total + m] = Action(Kind.B, m)
    assert None not in slots
    return slots  # type: ignore[return-value]


def pytorch_style_1f1b(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """PyTorch Schedule1F1B's phrasing: min(M, S - s) warmup forwards, then B/F pairs, then Bs."""
    warmup = min(num_microbatches, num_stages - stage)
    order = [Action(Kind.F, m) for m in range(warmup)]
    forward, backward = warmup, 0
    while backward < num_microbatches:
        order.append(Action(Kind.B, backward))
        backward += 1
        if forward < num_microbatches:
            order.append(Action(Kind.F, forward))
            forward += 1
    return order


def check_f_and_b_once_in_order(actions: list[Action], num_microbatches: int) -> None:
    expected = {Action(k, m) for k in (Kind.F, Kind.B) for m in range(num_microbatches)}
    assert len(actions) == len(expected) and set(actions) == expected
    for m in range(num_microbatches):
        assert actions.index(Action(Kind.F, m)) < actions.index(Action(Kind.B, m))


@pytest.mark.parametrize("num_stages, num_microbatches", GRID)
def test_generators_follow_written_rules(num_stages: int, num_microbatches: int) -> None:
    forwards = [Action(Kind.F, m) for m in range(num_microbatches)]
    backwards = [Action(Kind.B, m) for m in range(num_microbatches)]
    schedule = gpipe(num_stages, num_microbatches)
    assert len(schedule) == num_stages
    for actions in schedule:
        check_f_and_b_once_in_order(actions, num_microbatches)
        assert actions == forwards + backwards
        assert in_flight_peak(actions) == num_microbatches  # GPipe holds every microbatch

    schedule = one_f_one_b(num_stages, num_microbatches)
    assert len(schedule) == num_stages
    for stage, actions in enumerate(schedule):
        check_f_and_b_once_in_order(actions, num_microbatches)
        assert actions == one_f_one_b_closed_form(num_stages, num_microbatches, stage)
        assert actions == pytorch_style_1f1b(num_stages, num_microbatches, stage)
        assert in_flight_peak(actions) <= num_stages - stage
        assert in_flight_peak(actions) == min(num_stages - stage, num_microbatches)


@pytest.mark.parametrize("num_stages, num_microbatches", GRID)
def test_zero_bubble_h1_follows_written_rules(num_stages: int, num_microbatches: int) -> None:
    """ZB-H1 = 1F1B's order of forwards and input gradients, each stage s placing its W (in microbatch
    order) right after its I's, but s of them late, and the late ones at the end."""
    schedule = zero_bubble_h1(num_stages, num_microbatches)
    assert len(schedule) == num_stages
    for stage, actions in enumerate(schedule):
        without_w = [Action(Kind.B, a.mb) if a.kind is Kind.I else a for a in actions if a.kind is not Kind.W]
        assert without_w == one_f_one_b(num_stages, num_microbatches)[stage]
        weights = [a.mb for a in actions if a.kind is Kind.W]
        assert weights == list(range(num_microbatches))
        for m in range(num_microbatches):
            w = actions.index(Action(Kind.W, m))
            if m + stage < num_microbatches:  # right after the I that is `stage` input gradients later
                assert actions[w - 1] == Action(Kind.I, m + stage)
            else:  # the delayed tail: after the last I
                assert w > actions.index(Action(Kind.I, num_microbatches - 1))
        # activations are kept until the W: every stage peaks where 1F1B's stage 0 does
        live = [
            sum(1 if a.kind is Kind.F else -1 if a.kind is Kind.W else 0 for a in actions[: i + 1])
            for i in range(len(actions))
        ]
        assert max(live) == min(num_stages, num_microbatches)
    assert compute_schedule("zbh1", num_stages, num_microbatches) == schedule


def test_zero_bubble_h1_example() -> None:
    assert [format_actions(a) for a in zero_bubble_h1(3, 4)] == [
        "F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3",
        "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
        "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3",
    ]


def test_compute_schedule_dispatch_and_errors() -> None:
    assert compute_schedule("gpipe", 2, 3) == gpipe(2, 3)
    assert compute_schedule("1f1b", 2, 3) == one_f_one_b(2, 3)
    assert compute_schedule("interleaved", 2, 4, chunks=3) == interleaved_1f1b(2, 4, 3)
    with pytest.raises(ValueError, match=r"unknown schedule 'zb' \(known: 1f1b, gpipe, interleaved, zbh1\)"):
        compute_schedule("zb", 2, 3)
    with pytest.raises(ValueError, match=r"schedule '1f1b' has one chunk per stage, got chunks=2"):
        compute_schedule("1f1b", 2, 4, chunks=2)
    with pytest.raises(ValueError, match="num_stages=0"):
        gpipe(0, 3)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        one_f_one_b(2, 0)


# --------------------------------------------------------------------------- lowering


@pytest.mark.parametrize("num_stages, num_microbatches", GRID)
def test_lowering_adds_paired_communication(num_stages: int, num_microbatches: int) -> None:
    for kind in KINDS:
        check_lowering(kind, num_stages, num_microbatches)


def check_lowering(kind: str, num_stages: int, num_microbatches: int) -> None:
    compute = compute_schedule(kind, num_stages, num_microbatches)
    lowered = build(kind, num_stages, num_microbatches)
    flat = [action for actions in lowered for action in actions]
    sends = sum(action.kind in (Kind.SEND_F, Kind.SEND_B) for action in flat)
    recvs = sum(action.kind in (Kind.RECV_F, Kind.RECV_B) for action in flat)
    assert sends == recvs == 2 * num_microbatches * (num_stages - 1)
    last = num_stages - 1
    for stage, (before, after) in enumerate(zip(compute, lowered)):
        # Removing the communication gives back the compute order.
        assert [a for a in after if a.kind not in COMM_KINDS] == before
        for index, action in enumerate(after):
            prev = after[index - 1] if index else None
            nxt = after[index + 1] if index + 1 < len(after) else None
            if action.kind is Kind.F:
                assert (prev == Action(Kind.RECV_F, action.mb)) == (stage > 0)
                assert (nxt == Action(Kind.SEND_F, action.mb)) == (stage < last)
            if action.kind in (Kind.B, Kind.I):
                assert (prev == Action(Kind.RECV_B, action.mb)) == (stage < last)
                assert (nxt == Action(Kind.SEND_B, action.mb)) == (stage > 0)


def test_lowering_keeps_chunks_and_rejects_lowered_input() -> None:
    # Two stages, two chunks: virtual stages 0 1 2 3 are (stage, chunk) (0,0) (1,0) (0,1) (1,1);
    # stage 1's chunk 0 sends forward to stage 0's chunk 1 (the wrap), gradients come back the same way.
    compute = [parse_actions("F0 F0.1 B0.1 B0")] * 2
    assert num_chunks(compute) == 2
    assert format_actions(lower(compute)[0]) == (
        "F0 SEND_F0 RECV_F0.1 F0.1 SEND_F0.1 RECV_B0.1 B0.1 SEND_B0.1 RECV_B0 B0"
    )
    assert format_actions(lower(compute)[1]) == ("RECV_F0 F0 SEND_F0 RECV_F0.1 F0.1 B0.1 SEND_B0.1 RECV_B0 B0 SEND_B0")
    validate(lower(compute), 1)
    with pytest.raises(ScheduleError, match="already has communication"):
        lower(build("1f1b", 2, 2))
    with pytest.raises(ScheduleError, match=r"^lower: stage 0: F0.1 names chunk 1, but there are 1 chunks"):
        lower(compute, chunks=1)


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


# --------------------------------------------------------------------------- interleaved 1F1B

INTERLEAVED_GRID = [
    (stages, chunks, mbs) for stages in range(2, 5) for chunks in (2, 3) for mbs in range(stages, 9, stages)
]


def megatron_interleaved(num_stages: int, num_microbatches: int, chunks: int, stage: int) -> list[Action]:
    """Megatron-LM's order, phrased as its loop: microbatches go in groups of S; a group runs
    through chunk 0, 1, ... forwards and through the chunks in reverse backwards; stage s does
    min(2 (S - s - 1) + (chunks - 1) S, chunks M) warmup forwards, then F/B pairs, then Bs."""
    forwards, backwards = [], []
    for first in range(0, num_microbatches, num_stages):
        group = range(first, first + num_stages)
        forwards += [Action(Kind.F, m, c) for c in range(chunks) for m in group]
        backwards += [Action(Kind.B, m, c) for c in reversed(range(chunks)) for m in group]
    total = len(forwards)
    warmup = min(2 * (num_stages - stage - 1) + (chunks - 1) * num_stages, total)
    order = forwards[:warmup]
    for k in range(total - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[total - warmup :]


def chunk_peak(actions: list[Action]) -> int:
    """Most (microbatch, chunk) pairs with forward run and backward not yet."""
    return in_flight_peak(actions)


@pytest.mark.parametrize("num_stages, chunks, num_microbatches", INTERLEAVED_GRID)
def test_interleaved_follows_megatron_and_validates(num_stages: int, chunks: int, num_microbatches: int) -> None:
    compute = interleaved_1f1b(num_stages, num_microbatches, chunks)
    assert len(compute) == num_stages
    for stage, actions in enumerate(compute):
        # Each (mb, chunk) has exactly one F and one B, the F first.
        expected = {
            Action(kind, m, c) for kind in (Kind.F, Kind.B) for m in range(num_microbatches) for c in range(chunks)
        }
        assert len(actions) == len(expected) and set(actions) == expected
        for m, c in itertools.product(range(num_microbatches), range(chunks)):
            assert actions.index(Action(Kind.F, m, c)) < actions.index(Action(Kind.B, m, c))
        assert actions == megatron_interleaved(num_stages, num_microbatches, chunks, stage)
        warmup = min(2 * (num_stages - stage - 1) + (chunks - 1) * num_stages, chunks * num_microbatches)
        assert chunk_peak(actions) == min(warmup + 1, chunks * num_microbatches)
    validate(compute, num_microbatches)

    lowered = lower(compute)
    assert lowered == build("interleaved", num_stages, num_microbatches, chunks=chunks)
    validate(lowered, num_microbatches)
    flat = [action for actions in lowered for action in actions]
    # Every virtual-stage boundary (S * chunks - 1 of them) carries each microbatch once each way.
    hops = num_stages * chunks - 1
    assert sum(a.kind in (Kind.SEND_F, Kind.SEND_B) for a in flat) == 2 * num_microbatches * hops
    assert sum(a.kind in (Kind.RECV_F, Kind.RECV_B) for a in flat) == 2 * num_microbatches * hops
    for before, after in zip(compute, lowered):
        assert [a for a in after if a.kind not in COMM_KINDS] == before
    # No deadlock: the lockstep run finishes every action.
    ran = [event for round_ in simulate_order(lowered) for event in round_]
    assert len(ran) == len(flat)


@pytest.mark.parametrize("num_stages, num_microbatches", [(2, 3), (4, 6), (3, 4), (4, 2)])
def test_interleaved_needs_microbatches_multiple_of_stages(num_stages: int, num_microbatches: int) -> None:
    with pytest.raises(
        ValueError, match=rf"multiple of num_stages, got num_microbatches={num_microbatches}, num_stages={num_stages}"
    ):
        interleaved_1f1b(num_stages, num_microbatches, 2)
    with pytest.raises(ValueError, match="chunks=0"):
        interleaved_1f1b(2, 2, 0)


def test_wrap_peers_and_requirements() -> None:
    send = Action(Kind.SEND_F, 3, 0)
    # The last stage's chunk 0 feeds stage 0's chunk 1; the last chunk of the last stage has no next.
    assert peer(3, send, 4, chunks=2) == (0, Action(Kind.RECV_F, 3, 1))
    assert peer(0, Action(Kind.RECV_F, 3, 1), 4, chunks=2) == (3, Action(Kind.SEND_F, 3, 0))
    assert peer(0, Action(Kind.SEND_B, 3, 1), 4, chunks=2) == (3, Action(Kind.RECV_B, 3, 0))
    assert peer(3, Action(Kind.RECV_B, 3, 0), 4, chunks=2) == (0, Action(Kind.SEND_B, 3, 1))
    assert peer(3, Action(Kind.SEND_F, 3, 1), 4, chunks=2)[0] == 4  # does not exist
    assert peer(0, Action(Kind.RECV_F, 3, 0), 4, chunks=2)[0] == -1
    assert peer(1, Action(Kind.SEND_F, 3, 1), 4, chunks=2) == (2, Action(Kind.RECV_F, 3, 1))
    # One chunk: the adjacent stage, whatever the chunk label (and num_stages is not needed).
    assert peer(3, send) == (4, Action(Kind.RECV_F, 3, 0))
    with pytest.raises(ValueError, match="num_stages is needed"):
        peer(3, send, chunks=2)
    # Compute-only reading: F on stage 0, chunk 1 needs F of chunk 0 on the last stage.
    f01 = Action(Kind.F, 0, 1)
    assert requirements(0, f01, 4, lowered=False, chunks=2) == ((3, Action(Kind.F, 0, 0)),)
    assert requirements(3, Action(Kind.B, 0, 0), 4, lowered=False, chunks=2) == (
        (3, Action(Kind.F, 0, 0)),
        (0, Action(Kind.I, 0, 1)),
    )  # the input gradient: from an I or a B
    assert requirements(3, Action(Kind.B, 0, 1), 4, lowered=True, chunks=2) == ((3, Action(Kind.F, 0, 1)),)
    assert requirements(0, f01, 4, chunks=2) == ((0, Action(Kind.RECV_F, 0, 1)),)


def test_interleaved_deadlock_names_the_wrap() -> None:
    # Stage 0 runs chunk 1 of mb 0 before chunk 0: it waits for stage 1, which waits for it.
    compute = [parse_actions("F0.1 F0 B0.1 B0"), parse_actions("F0 F0.1 B0.1 B0")]
    with pytest.raises(ScheduleError) as info:
        validate(compute, 1)
    lines = str(info.value).splitlines()
    assert lines[0] == (
        "deadlock: stage 0 waits at F0.1 (step 0) for F0 on stage 1, which never comes (stage 1 is stuck at F0, step 0)"
    )
    assert lines[2].split() == ["0", "F0.1", "<--", "ERROR", "HERE", "F0", "<--", "ERROR", "HERE"]


# --------------------------------------------------------------------------- schedule files


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_load_text_compute_only_is_lowered(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "sched.txt",
        """\
# 1F1B on two stages, three microbatches
F0 F1 B0 F2 B1 B2   # stage 0

F0 B0 F1 B1 F2 B2
""",
    )
    assert load_schedule_file(path, 2, 3) == build("1f1b", 2, 3)


def test_load_text_lowered_is_kept(tmp_path: Path) -> None:
    lowered = build("gpipe", 3, 2)
    text = "\n".join(format_actions(actions) for actions in lowered) + "\n"
    assert load_schedule_file(write(tmp_path, "lowered.sched", text), 3, 2) == lowered


def test_load_interleaved_text(tmp_path: Path) -> None:
    compute = interleaved_1f1b(2, 4, 2)
    text = "\n".join(format_actions(actions) for actions in compute)
    loaded = load_schedule_file(write(tmp_path, "interleaved.txt", text), 2, 4)
    assert loaded == build("interleaved", 2, 4, chunks=2)


def test_load_csv(tmp_path: Path) -> None:
    # Uneven columns: the grid format_grid prints, as CSV; a comment line in between.
    path = write(
        tmp_path,
        "sched.csv",
        """\
stage 0,stage 1
F0,F0
F1,B0
# the steady state
B0,F1
B1,B1
""",
    )
    assert load_schedule_file(path, 2, 2) == lower([parse_actions("F0 F1 B0 B1"), parse_actions("F0 B0 F1 B1")])
    uneven = write(tmp_path, "uneven.txt", "stage 0, stage 1\nF0,RECV_F0\nSEND_F0,F0\nRECV_B0,B0\nB0,SEND_B0\n")
    assert load_schedule_file(uneven, 2, 1) == build("gpipe", 2, 1)


@pytest.mark.parametrize(
    "name, text, stages, mbs, error",
    [
        ("a.txt", "F0 B0\nF0 X1 B0\n", 2, 1, r"^a.txt: line 2: stage 1 action 1: bad action 'X1': expected KIND"),
        (
            "a.txt",
            "# two lines for three stages\nF0 B0\n\nF0 B0\n",
            3,
            1,
            r"^a.txt: line 4: 2 stage lines, expected 3 \(one line of space-separated actions per stage\)",
        ),
        ("a.txt", "F0 B0\nF0 B0\nF0 B0\n", 2, 1, r"^a.txt: line 3: 3 stage lines, expected 2"),
        (
            "a.txt",
            "F0 F1 B0 B1\nF0 F1 B0\n",
            2,
            2,
            r"^a.txt: line 2: stage 1 is missing B1 \(every stage runs F and B \(or I and W\) exactly once",
        ),
        (
            "a.txt",
            "F0 B0\nF0 B0 F1 B1\n",
            2,
            1,
            r"^a.txt: line 2: stage 1 step 2: F1 names microbatch 1, but there are 1 \(0..0\)",
        ),
        (
            "a.txt",
            "F0 B0 B1 F1\nF0 B0 F1 B1\n",
            2,
            2,
            r"^a.txt: line 1: stage 0 step 2: B1 needs F1 first, but F1 comes later \(step 3\)",
        ),
        (
            "a.txt",
            "F0 SEND_F0 RECV_B0 B0\nF0 B0 SEND_B0\n",
            2,
            1,
            r"^a.txt: line 1: stage 0 step 1: SEND_F0 has no matching RECV_F0 on stage 1",
        ),
        (
            "dead.txt",
            "F0 RECV_B0 SEND_F0 B0\nRECV_F0 F0 B0 SEND_B0\n",
            2,
            1,
            r"^dead.txt: line 1: deadlock: stage 0 waits at RECV_B0 \(step 1\) for SEND_B0 on stage 1",
        ),
        ("empty.txt", "# nothing\n\n", 2, 1, r"^empty.txt: no actions \(expected one line per stage, 2 stages\)"),
        (
            "b.csv",
            "stage 0,stage 2\nF0,F0\n",
            2,
            1,
            r"^b.csv: line 1: header 'stage 0,stage 2', expected 'stage 0,stage 1' \(one column per stage\)",
        ),
        ("b.csv", "stage 0,stage 1\nF0,F0,F0\n", 2, 1, r"^b.csv: line 2: 3 cells, but the header has 2 stages"),
        ("b.csv", "stage 0,stage 1\nF0,F0\nB0,F1\n", 2, 1, r"^b.csv: line 3: stage 1 step 1: F1 names microbatch 1"),
        ("b.csv", "stage 0,stage 1\nF0,F0\nB0,\n", 2, 1, r"^b.csv: line 1: stage 1 is missing B0"),
        ("b.csv", "stage 0,stage 1\nF0,F0\nB0,B-1\n", 2, 1, r"^b.csv: line 3: stage 1: bad action 'B-1'"),
        (
            "b.csv",
            "stage 0,stage 1\nF0,B0\nB0,F0\n",
            2,
            1,
            r"^b.csv: line 2: stage 1 step 0: B0 needs F0 first, but F0 comes later \(step 1\)",
        ),
    ],
)
def test_load_schedule_file_errors(tmp_path: Path, name: str, text: str, stages: int, mbs: int, error: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(ScheduleError, match=error.replace("^", "^" + re.escape(str(tmp_path) + "/"), 1)):
        load_schedule_file(path, stages, mbs)


def test_load_schedule_file_error_keeps_the_grid(tmp_path: Path) -> None:
    path = write(tmp_path, "dead.txt", "F0 RECV_B0 SEND_F0 B0\nRECV_F0 F0 B0 SEND_B0\n")
    with pytest.raises(ScheduleError) as info:
        load_schedule_file(path, 2, 1)
    lines = str(info.value).splitlines()
    assert lines[1].split() == ["step", "stage", "0", "stage", "1"]
    assert "RECV_B0 <-- ERROR HERE" in lines[3]


def test_load_schedule_file_missing(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match=r"nope.txt: cannot read schedule file: No such file"):
        load_schedule_file(tmp_path / "nope.txt", 2, 1)


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
