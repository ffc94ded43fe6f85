"""Schedule IR, generators, lowering and validator against written rules.

Generators are checked over a grid of (stages 1..5, microbatches 1..9).
"""

from __future__ import annotations

import itertools

import pytest

from hetero_llm.errors import ScheduleError
from hetero_llm.schedule import (
    COMM_KINDS,
    Action,
    Kind,
    build,
    compute_schedule,
    format_actions,
    format_grid,
    gpipe,
    lower,
    one_f_one_b,
    parse_actions,
    simulate_order,
    validate,
)

GRID = list(itertools.product(range(1, 6), range(1, 10)))  # (num_stages, num_microbatches)
KINDS = ["gpipe", "1f1b"]


# --------------------------------------------------------------------------- IR


@pytest.mark.parametrize("kind", list(Kind))
def test_action_str_parse_round_trip(kind: Kind) -> None:
    for mb, chunk in [(0, 0), (3, 0), (12, 0), (0, 1), (7, 2), (10, 11)]:
        action = Action(kind, mb, chunk)
        text = str(action)
        assert text == f"{kind.value}{mb}" + (f".{chunk}" if chunk else "")
        assert Action.parse(text) == action
        assert eval(repr(action)) == action  # noqa: S307 - repr is documented to be evaluable


def test_action_examples() -> None:
    assert str(Action(Kind.F, 3)) == "F3"
    assert str(Action(Kind.SEND_B, 0, 2)) == "SEND_B0.2"
    assert Action.parse("F3.1") == Action(Kind.F, 3, 1)
    assert Kind.SEND_F.value == "SEND_F"


@pytest.mark.parametrize(
    "text",
    ["", "F", "3F", "X3", "f3", "F-1", "F3.", "F3.x", "SEND3", "SEND_X3", "F3 B3", "F03", "F3.0",
     "F3.01", "RECV_F", "W1.2.3"],
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
    actions = [
        Action(Kind.F, 0), Action(Kind.SEND_F, 0, 1), Action(Kind.RECV_B, 2), Action(Kind.W, 9)
    ]
    assert format_actions(actions) == "F0 SEND_F0.1 RECV_B2 W9"
    assert parse_actions(format_actions(actions)) == actions
    assert parse_actions("  F0\n B0 ") == [Action(Kind.F, 0), Action(Kind.B, 0)]
    assert parse_actions("") == []
    with pytest.raises(ScheduleError, match=r"^action 2: bad action 'Q1'"):
        parse_actions("F0 B0 Q1")


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


def test_compute_schedule_dispatch_and_errors() -> None:
    assert compute_schedule("gpipe", 2, 3) == gpipe(2, 3)
    assert compute_schedule("1f1b", 2, 3) == one_f_one_b(2, 3)
    with pytest.raises(ValueError, match=r"unknown schedule 'zb' \(known: 1f1b, gpipe\)"):
        compute_schedule("zb", 2, 3)
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
            if action.kind is Kind.B:
                assert (prev == Action(Kind.RECV_B, action.mb)) == (stage < last)
                assert (nxt == Action(Kind.SEND_B, action.mb)) == (stage > 0)


def test_lowering_keeps_chunks_and_rejects_lowered_input() -> None:
    compute = [[Action(Kind.F, 0, 1), Action(Kind.B, 0, 1)]] * 2
    assert format_actions(lower(compute)[0]) == "F0.1 SEND_F0.1 RECV_B0.1 B0.1"
    assert format_actions(lower(compute)[1]) == "RECV_F0.1 F0.1 B0.1 SEND_B0.1"
    with pytest.raises(ScheduleError, match="already has communication"):
        lower(build("1f1b", 2, 2))


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


def test_missing_backward_is_named() -> None:
    schedule = gpipe(2, 3)
    schedule[1] = [a for a in schedule[1] if a != Action(Kind.B, 1)]
    with pytest.raises(ScheduleError) as info:
        validate(schedule, 3)
    assert str(info.value).splitlines()[0] == (
        "stage 1 is missing B1 (every stage runs F and B exactly once per microbatch 0..2)"
    )
    assert "stage 0" in str(info.value).splitlines()[1]  # the grid follows


@pytest.mark.parametrize(
    "stages, num_microbatches, error",
    [
        (["F0 F0 B0"], 1, r"^stage 0 runs F0 twice \(steps 0 and 1\)"),
        (["F0 B0 F1 B1"], 1, r"^stage 0 step 2: F1 names microbatch 1, but there are 1 \(0..0\)"),
        (["B0 F0"], 1, r"^stage 0 step 0: B0 needs F0 first, but F0 comes later \(step 1\)"),
        (["RECV_F0 F0 B0"], 1,
         r"^stage 0 step 0: RECV_F0 talks to stage -1, but stage 0 has no previous"),
        (["F0 SEND_F0 B0", "F0 B0"], 1,
         r"^stage 0 step 1: SEND_F0 has no matching RECV_F0 on stage 1"),
        (["F0 SEND_F0 RECV_B0 B0", "RECV_F0 F0 B0"], 1,
         r"^stage 0 step 2: RECV_B0 has no matching SEND_B0 on stage 1"),
        (["F0 SEND_F0 RECV_B0 B0", "RECV_F0 F0 B0 SEND_B0 W0 W0"], 1, r"^stage 1 runs W0 twice"),
        (["F0 B0 W0", "F0 B0"], 1, None),  # W is allowed once after its B
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
