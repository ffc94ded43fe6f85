"""Cost-model simulator against closed forms (GPipe, 1F1B, interleaved 1F1B) and its own rules."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import attrs
import pytest

from hetero_llm.errors import ScheduleError
from hetero_llm.predict.simulate import CostModel, SimResult, simulate
from hetero_llm.schedule import Action, Kind, add_optimizer_actions, build, compute_schedule, parse_actions

GRID = list(itertools.product(range(1, 6), range(1, 9)))  # (num_stages, num_microbatches)
TIMES = [(1.0, 2.0), (1.0, 1.0), (0.003, 0.005)]  # (t_f, t_b) in seconds


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("num_stages, num_microbatches", GRID)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_equal_stages_closed_form(kind: str, num_stages: int, num_microbatches: int) -> None:
    for t_f, t_b in TIMES:
        result = simulate(build(kind, num_stages, num_microbatches), CostModel.uniform(num_stages, t_f, t_b))
        step = (num_microbatches + num_stages - 1) * (t_f + t_b)
        assert result.step_time == approx(step)
        for stage in range(num_stages):
            assert result.busy[stage] == approx(num_microbatches * (t_f + t_b))
            assert result.bubble[stage] == approx((num_stages - 1) / (num_microbatches + num_stages - 1))
        assert result.mean_bubble == approx((num_stages - 1) / (num_microbatches + num_stages - 1))
    expected_peaks = [
        num_microbatches if kind == "gpipe" else min(num_stages - stage, num_microbatches)
        for stage in range(num_stages)
    ]
    assert list(result.peak_in_flight) == expected_peaks


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
def test_compute_only_and_lowered_agree(kind: str) -> None:
    chunks = 2 if kind == "interleaved" else 1
    for latency in (0.0, 0.3):
        cost = CostModel.uniform(4, 1.0, 2.0, latency=latency)
        lowered = simulate(build(kind, 4, 8, chunks=chunks), cost)
        compute = simulate(compute_schedule(kind, 4, 8, chunks=chunks), cost)
        assert compute.step_time == approx(lowered.step_time)
        assert compute.busy == lowered.busy


def test_compute_only_with_optimizer_actions_agrees_with_lowered() -> None:
    """RS/AG are no communication: a compute-only schedule carrying them is still read as compute-only (it
    once counted as lowered, and simulate failed with a KeyError looking for RECV_F0)."""
    cost = attrs.evolve(CostModel.uniform(3, 1.0, 2.0, latency=0.3), reduce_scatter=(0.5,) * 3, all_gather=(0.25,) * 3)
    compute = simulate(add_optimizer_actions(compute_schedule("1f1b", 3, 4)), cost)
    lowered = simulate(add_optimizer_actions(build("1f1b", 3, 4)), cost)
    assert compute.step_time == approx(lowered.step_time)
    assert compute.busy == lowered.busy


@pytest.mark.parametrize("slow", range(4))
def test_slow_stage_dominates(slow: int) -> None:
    """One stage three times slower (T = 3t, with T_f >= t_f + t_b): GPipe takes M T plus the
    fill and drain of all the others, 1F1B only of the stages before the slow one (the later
    ones' round trip hides behind the slow stage's warmup forwards)."""
    num_stages, num_microbatches, t_f, t_b = 4, 8, 1.0, 2.0
    forward, backward = [t_f] * num_stages, [t_b] * num_stages
    forward[slow], backward[slow] = 3 * t_f, 3 * t_b
    cost = CostModel(forward, backward, latency=[0.0] * 3, bandwidth=[math.inf] * 3)
    slow_total = num_microbatches * 3 * (t_f + t_b)
    gpipe = simulate(build("gpipe", num_stages, num_microbatches), cost)
    assert gpipe.step_time == approx(slow_total + (num_stages - 1) * (t_f + t_b))
    one_f_one_b = simulate(build("1f1b", num_stages, num_microbatches), cost)
    assert one_f_one_b.step_time == approx(slow_total + slow * (t_f + t_b))
    for result in (gpipe, one_f_one_b):
        assert result.bubble[slow] == min(result.bubble)
        assert result.bubble[slow] < 0.15 < min(b for s, b in enumerate(result.bubble) if s != slow)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 5])
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_latency_adds_two_hops_per_boundary(kind: str, num_stages: int) -> None:
    schedule = build(kind, num_stages, 1)
    free = simulate(schedule, CostModel.uniform(num_stages, 1.0, 2.0))
    latency, size, bandwidth = 0.25, 1e6, 4e6
    for cost, hop in [
        (CostModel.uniform(num_stages, 1.0, 2.0, latency=latency), latency),
        (
            CostModel.uniform(num_stages, 1.0, 2.0, latency=latency, bandwidth=bandwidth, activation_bytes=size),
            latency + size / bandwidth,
        ),
    ]:
        slow = simulate(schedule, cost)
        assert slow.step_time - free.step_time == approx(2 * (num_stages - 1) * hop)


def test_rendezvous_waits_for_the_receivers_notice_when_it_posts_late() -> None:
    """GPipe, 2 stages, 2 microbatches (F 1 s, B 2 s, a 0.1 s link). Stage 1 reaches RECV_F1 at 2.1 s, after
    F1's data was sent (2 s): over a rendezvous link it moves only once the notice is back, at 2.2, and is
    there at 2.3 (not 2.1). Stage 0 reaches RECV_B1 at 7.4, after B1's gradient was sent (7.3): there at 7.6
    (not 7.4). The step: 9.6 s, against 9.2 without. A receive posted before its send changes nothing (F0)."""
    schedule = build("gpipe", 2, 2)

    def cost(meet):
        return CostModel(forward=[1, 1], backward=[2, 2], latency=[0.1], bandwidth=[math.inf], rendezvous=meet)

    plain, meet = simulate(schedule, cost(None)), simulate(schedule, cost([True]))
    assert simulate(schedule, cost([False])).step_time == approx(plain.step_time)
    assert (plain.step_time, meet.step_time) == (approx(9.2), approx(9.6))
    starts = {str(t.action): t.start for t in meet.timeline[1] if t.action.kind is Kind.F}
    assert starts == {"F0": approx(1.1), "F1": approx(2.3)}
    assert simulate(compute_schedule("gpipe", 2, 2), cost([True])).step_time == approx(9.6)
    with pytest.raises(ValueError, match="rendezvous has 2"):
        cost([True, True])


def test_links_are_per_boundary() -> None:
    # Only the link 1 -> 2 is slow; M = 1 crosses it once each way.
    cost = CostModel([1.0] * 3, [2.0] * 3, latency=[0.0, 0.5], bandwidth=[math.inf, math.inf])
    assert simulate(build("1f1b", 3, 1), cost).step_time == approx(9.0 + 2 * 0.5)


@pytest.mark.parametrize(
    "num_stages, chunks, num_microbatches", [(s, c, m) for s in range(2, 5) for c in (2, 3) for m in range(s, 9, s)]
)
def test_interleaved_closed_form_and_smaller_bubble(num_stages: int, chunks: int, num_microbatches: int) -> None:
    """Equal stages, free links: step (M + (S - 1) / chunks)(t_f + t_b),
    bubble (S - 1) / (chunks M + S - 1), below 1F1B's (S - 1) / (M + S - 1)."""
    for t_f, t_b in TIMES:
        cost = CostModel.uniform(num_stages, t_f, t_b)
        result = simulate(build("interleaved", num_stages, num_microbatches, chunks=chunks), cost)
        assert result.step_time == approx((num_microbatches + (num_stages - 1) / chunks) * (t_f + t_b))
        bubble = (num_stages - 1) / (chunks * num_microbatches + num_stages - 1)
        assert result.bubble == approx((bubble,) * num_stages)
        baseline = simulate(build("1f1b", num_stages, num_microbatches), cost)
        assert result.mean_bubble < baseline.mean_bubble


def test_interleaved_memory_counts_chunks() -> None:
    cost = CostModel.uniform(4, 1.0, 2.0, activation_bytes=1000.0)
    result = simulate(build("interleaved", 4, 8, chunks=2), cost)
    # Stage s runs 2 (S - s - 1) + S warmup forwards, then one more before its first backward.
    assert result.peak_in_flight == (11, 9, 7, 5)
    assert result.peak_activation_bytes == (5500.0, 4500.0, 3500.0, 2500.0)  # a chunk holds half
    one_f_one_b = simulate(build("1f1b", 4, 8), cost)
    assert one_f_one_b.peak_activation_bytes == (4000.0, 3000.0, 2000.0, 1000.0)


def test_interleaved_wrap_link_needs_its_entry() -> None:
    schedule = build("interleaved", 3, 3, chunks=2)
    three_links = CostModel([1.0] * 3, [2.0] * 3, latency=[0.0, 0.0, 0.5], bandwidth=[math.inf] * 3)
    linear = CostModel.uniform(3, 1.0, 2.0)
    assert simulate(schedule, three_links).step_time > simulate(schedule, linear).step_time
    two_links = CostModel([1.0] * 3, [2.0] * 3, latency=[0.0, 0.0], bandwidth=[math.inf] * 2)
    with pytest.raises(ValueError, match=r"between stage 2 and stage 0 \(the interleaved wrap link\)"):
        simulate(schedule, two_links)


def check_timeline(schedule: list[list[Action]], result: SimResult, cost: CostModel) -> None:
    """Compute never overlaps on a stage and runs in list order; data dependencies hold."""
    when = {}
    for stage, (actions, timed) in enumerate(zip(schedule, result.timeline)):
        assert [t.action for t in timed] == actions
        previous_end = 0.0
        for t in timed:
            assert t.start <= t.end
            if t.action.kind in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.RECV_F, Kind.RECV_B):
                assert t.start >= previous_end - 1e-12
                previous_end = t.end
            when[(stage, t.action)] = t
    for (stage, action), t in when.items():
        if action.kind is Kind.RECV_F and stage > 0:
            send = when[(stage - 1, Action(Kind.SEND_F, action.mb, action.chunk))]
            # The send's data lands at start + transfer; the recv ends then or, if the stage
            # got there later, when it got there.
            assert send.end == approx(send.start + cost.transfer(stage - 1, stage))
            assert t.end == approx(max(send.end, t.start))
        if action.kind is Kind.F:
            assert t.end - t.start == approx(cost.forward[stage])


def test_timeline_respects_dependencies() -> None:
    schedule = build("1f1b", 4, 6)
    cost = CostModel(
        [1.0, 1.5, 0.5, 1.0],
        [2.0, 3.0, 1.0, 2.0],
        latency=[0.1, 0.4, 0.2],
        bandwidth=[1e9, 1e8, 1e9],
        activation_bytes=1e7,
    )
    result = simulate(schedule, cost)
    check_timeline(schedule, result, cost)
    assert result.step_time == max(t.end for row in result.timeline for t in row)
    rows = result.rows()
    assert rows[0][0] == ("F0", 0.0, 1.0)
    assert "step time" in result.summary() and result.summary().count("\n") == 5


def test_weight_gradient_split() -> None:
    # Two stages, one microbatch, I then W: I takes backward - weight; W fills the remaining time.
    schedule = [parse_actions("F0 I0 W0"), parse_actions("F0 I0 W0")]
    cost = CostModel([1.0, 1.0], [3.0, 3.0], latency=[0.0], bandwidth=[math.inf], weight=[1.0, 1.0])
    result = simulate(schedule, cost)
    stage0 = {str(t.action): (t.start, t.end) for t in result.timeline[0]}
    assert stage0["I0"] == (4.0, 6.0)  # waits for stage 1's F (1..2) and I (2..4), not for its W (4..5)
    assert stage0["W0"] == (6.0, 7.0)
    assert result.step_time == 7.0
    assert result.busy == (4.0, 4.0)
    # a full B on stage 1 produces the input gradient stage 0 waits for, after the whole backward
    mixed = simulate([parse_actions("F0 I0 W0"), parse_actions("F0 B0")], cost)
    assert {str(t.action): (t.start, t.end) for t in mixed.timeline[0]}["I0"] == (5.0, 7.0)
    with pytest.raises(ValueError, match="W actions: give CostModel.weight"):
        simulate(schedule, CostModel.uniform(2, 1.0, 3.0))


@pytest.mark.parametrize("num_stages", [2, 3, 4, 6])
@pytest.mark.parametrize("num_microbatches", [6, 8, 12])
def test_zero_bubble_h1_cuts_the_bubble_to_a_third(num_stages: int, num_microbatches: int) -> None:
    """With F = I = W and free links, 1F1B idles (S - 1)(F + I + W) per stage, ZB-H1 (S - 1)(F + I - W)
    (Qi et al., section 3): step times 3(M + S - 1) and 3M + S - 1, peak activations S on every stage."""
    m, s = num_microbatches, num_stages
    one_f_one_b = simulate(build("1f1b", s, m), CostModel.uniform(s, 1.0, 2.0))
    zb = simulate(build("zbh1", s, m), CostModel.uniform(s, 1.0, 2.0, weight=1.0))
    assert one_f_one_b.step_time == 3 * (m + s - 1)
    assert zb.step_time == 3 * m + s - 1
    assert zb.peak_in_flight == (s,) * s
    assert one_f_one_b.peak_in_flight == tuple(s - stage for stage in range(s))


def test_runtime_overhead_per_compute_action() -> None:
    """``overhead`` lengthens every compute action: 1F1B on equal stages takes (M + S - 1)(F + B + 2 overhead)."""
    plain = simulate(build("1f1b", 2, 4), CostModel.uniform(2, 1.0, 2.0))
    slowed = simulate(build("1f1b", 2, 4), CostModel([1.0, 1.0], [2.0, 2.0], [0.0], [math.inf], overhead=[0.5, 0.5]))
    assert (plain.step_time, slowed.step_time) == (15.0, 20.0)
    split = simulate(
        build("zbh1", 2, 4),
        CostModel([1.0, 1.0], [2.0, 2.0], [0.0], [math.inf], weight=[1.0, 1.0], overhead=[0.5, 0.5]),
    )
    assert split.busy == (4 * (1.0 + 2.0 + 3 * 0.5),) * 2  # a split backward is two actions: two overheads
    with pytest.raises(ValueError, match=r"CostModel.overhead has 1 entries, forward has 2"):
        CostModel([1.0, 1.0], [2.0, 2.0], [0.0], [math.inf], overhead=[0.5])


def test_deadlock_raises_the_validator_error() -> None:
    schedule = [parse_actions("F0 RECV_B0 SEND_F0 B0"), parse_actions("RECV_F0 F0 B0 SEND_B0")]
    with pytest.raises(ScheduleError) as info:
        simulate(schedule, CostModel.uniform(2, 1.0, 2.0))
    message = str(info.value)
    assert message.startswith("deadlock: stage 0 waits at RECV_B0 (step 1)")
    assert message.count("<-- ERROR HERE") == 2


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(forward=[], backward=[], latency=[], bandwidth=[]), "at least one stage"),
        (
            dict(forward=[1, 1], backward=[1], latency=[0], bandwidth=[1]),
            r"backward has 1 entries, forward has 2 \(one per stage\)",
        ),
        (
            dict(forward=[1, 1, 1], backward=[1, 1, 1], latency=[0], bandwidth=[1]),
            r"latency has 1 entries; 3 stages have 2 links",
        ),
        (
            dict(forward=[1, 1], backward=[1, 1], latency=[0], bandwidth=[1, 1]),
            r"latency has 1 entries but bandwidth has 2",
        ),
        (
            dict(forward=[1, -1], backward=[1, 1], latency=[0], bandwidth=[1]),
            r"CostModel.forward\[1\] must be >= 0, got -1.0",
        ),
        (
            dict(forward=[1, 1], backward=[1, 1], latency=[0], bandwidth=[0]),
            r"CostModel.bandwidth\[0\] must be > 0 bytes/s",
        ),
        (
            dict(forward=[1, 1], backward=[1, 1], latency=[math.nan], bandwidth=[1]),
            r"CostModel.latency\[0\] must be >= 0, got nan",
        ),
        (
            dict(forward=[1, 1], backward=[1, 1], latency=[0], bandwidth=[1], weight=[0.5, 2]),
            r"weight\[1\] = 2.0 s exceeds backward\[1\] = 1.0 s",
        ),
        (
            dict(forward=[1, 1], backward=[1, 1], latency=[0], bandwidth=[1], activation_bytes=-1),
            r"activation_bytes must be >= 0",
        ),
    ],
)
def test_cost_model_rejects_bad_numbers(kwargs: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        CostModel(**kwargs)


def test_stage_count_must_match() -> None:
    with pytest.raises(ValueError, match="CostModel has 3 stages, the schedule has 2"):
        simulate(build("1f1b", 2, 2), CostModel.uniform(3, 1.0, 1.0))


def test_schedule_and_simulator_import_no_torch_or_numpy() -> None:
    code = (
        "import sys, hetero_llm.schedule, hetero_llm.predict.simulate, hetero_llm.predict.trace; "
        "print(sorted(m for m in ('torch', 'numpy', 'matplotlib') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
