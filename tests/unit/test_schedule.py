"""Schedule IR, generators, lowering and interleaved 1F1B against written rules (the validator and the order of
receives: test_schedule_validator.py; schedule files: test_schedule_files.py).

Generators are checked over a grid of (stages 1..5, microbatches 1..9); interleaved 1F1B over
(stages 2..4, chunks 2..3, microbatches the multiples of stages up to 8).
"""

from __future__ import annotations

import itertools

import pytest

from hetero_llm.errors import ScheduleError
from hetero_llm.schedule import (
    COMM_KINDS,
    Action,
    Direction,
    Kind,
    build,
    compute_schedule,
    format_actions,
    gpipe,
    interleaved_1f1b,
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
