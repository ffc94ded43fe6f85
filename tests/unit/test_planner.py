"""hetero-plan: cost arithmetic, the search's rules on small cases and planned layouts (its command line and cluster
files: test_planner_cli.py; measured profiles: test_planner_profile.py; ZeRO-1: test_planner_zero1.py). Single
process."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from helpers_plan import flops_priced
from helpers_planner import small_cluster

from harness import LAYOUTS
from hetero_llm import layout as layout_mod
from hetero_llm import schedule as sched
from hetero_llm.model.params import layer_params, stage_params
from hetero_llm.planner import pipesim, plan_cluster, shares
from hetero_llm.planner.candidates import Candidate, PipelineChoice, StageChoice, TPGroup
from hetero_llm.planner.cluster import load_cluster
from hetero_llm.planner.cost import PlannerCostModel
from hetero_llm.planner.memory import ONE_IN_FLIGHT
from hetero_llm.planner.output import layout_text
from hetero_llm.planner.search import Planner, Structure
from hetero_llm.predict.simulate import CostModel, simulate

SMALL = LAYOUTS / "clusters" / "small_cpu.toml"


# interleaved needs >= 2 stages and microbatches divisible by them (a schedule rule): those cases are left out
SIM_GRID = [
    (kind, chunks, stages, mbs)
    for kind, chunks in [("1f1b", 1), ("zbh1", 1), ("interleaved", 2), ("gpipe", 1)]
    for stages, mbs in [(1, 1), (1, 3), (2, 2), (3, 5), (4, 8)]
    if kind != "interleaved" or (stages >= 2 and mbs % stages == 0)
]


@pytest.mark.parametrize("rendezvous", [False, True])
@pytest.mark.parametrize("kind,chunks,stages,microbatches", SIM_GRID)
def test_fast_simulator_equals_the_simulator(kind, chunks, stages, microbatches, rendezvous):
    rng = random.Random(stages * 100 + microbatches)
    fwd = [rng.uniform(0.5, 2) for _ in range(stages)]
    bwd = [f * rng.uniform(1.5, 3) for f in fwd]
    wgt = [b * rng.uniform(0.2, 0.5) for b in bwd]
    links = stages if kind == "interleaved" else stages - 1
    lat = [rng.uniform(0, 0.3) for _ in range(links)]
    bw = [rng.uniform(1, 10) for _ in range(links)]
    meet = [rng.random() < 0.7 for _ in range(links)] if rendezvous else None
    cost = CostModel(
        forward=fwd,
        backward=bwd,
        latency=lat,
        bandwidth=bw,
        activation_bytes=2.0,
        weight=wgt if kind == "zbh1" else None,
        rendezvous=meet,
    )
    want = simulate(sched.compute_schedule(kind, stages, microbatches, chunks=chunks), cost)
    lowered = simulate(sched.build(kind, stages, microbatches, chunks=chunks), cost)
    acts = pipesim.actions(kind, stages, microbatches, chunks)
    step, busy = pipesim.simulate(acts, fwd, bwd, wgt if kind == "zbh1" else None, lat, bw, 2.0, meet)
    assert step == pytest.approx(want.step_time, rel=1e-12)
    assert lowered.step_time == pytest.approx(want.step_time, rel=1e-12)  # explicit receives: the same step
    assert busy == pytest.approx(want.busy, rel=1e-12)
    assert pipesim.peak_in_flight(acts) == want.peak_in_flight
    # what the memory model reads: the most microbatches held whole or put off is the simulator's peak in flight
    held = pipesim.held_in_flight(acts)
    assert tuple(max(f + p for f, p, _ in points) for points in held) == want.peak_in_flight


def test_held_points_are_those_no_other_point_covers():
    """pipesim._largest (a skyline per gradients flag) against the plain pairwise filter, on random point sets."""
    rng = random.Random(0)
    for _ in range(2000):
        points = {(rng.randint(0, 6), rng.randint(0, 4), rng.randint(0, 1)) for _ in range(rng.randint(1, 15))}
        plain = [p for p in points if not any(q != p and all(a >= b for a, b in zip(q, p)) for q in points)]
        assert pipesim._largest(points) == tuple(sorted(plain))


def test_held_in_flight_says_when_gradients_exist_and_what_a_split_backward_puts_off():
    """GPipe holds every microbatch before any gradient exists; 1F1B's peak comes again after its first backward,
    beside the gradients; ZB-H1's last stage holds one microbatch whole and one put off (its W comes after the next
    forward) before its first W makes the gradients."""
    assert pipesim.held_in_flight(pipesim.actions("gpipe", 2, 3)) == (((2, 0, 1), (3, 0, 0)),) * 2
    assert pipesim.held_in_flight(pipesim.actions("1f1b", 2, 4))[0] == ((2, 0, 1),)
    assert pipesim.held_in_flight(pipesim.actions("zbh1", 2, 2))[1] == ((0, 1, 1), (0, 2, 0), (1, 1, 0))
    # in the steady state (more microbatches) the gradients exist beside one whole and one put off
    assert pipesim.held_in_flight(pipesim.actions("zbh1", 2, 8))[1] == ((0, 2, 1), (1, 1, 1))


def test_fast_actions_equal_the_schedule_generators():
    """pipesim.actions builds the tuples without schedule.Action: exactly the generators' schedules, for every
    kind over a grid (and the generators' own errors for what they refuse)."""
    for kind in ("gpipe", "1f1b", "zbh1", "interleaved"):
        for stages, microbatches in itertools.product(range(1, 9), range(1, 20)):
            for chunks in (1, 2, 3, 4) if kind == "interleaved" else (1,):
                if kind == "interleaved" and microbatches % stages:
                    continue
                fast = pipesim.actions.__wrapped__(kind, stages, microbatches, chunks)
                assert fast == pipesim.reference_actions(kind, stages, microbatches, chunks), (
                    kind,
                    stages,
                    microbatches,
                )
    for bad in (("interleaved", 3, 4, 2), ("1f1b", 2, 4, 2), ("1f1b", 0, 4, 1), ("zb", 2, 2, 1)):
        with pytest.raises(ValueError):
            pipesim.actions.__wrapped__(*bad)


def test_batch_shares_equal_the_plain_greedy_loop():
    """shares.batch_shares (a heap, unrolled for unit 1) gives the counts of the plain loop: each unit of
    microbatches to the pipeline whose time grows least, the lower index on a tie, on random inputs with ties."""

    def plain(fill, slow, unit, total):
        counts, left, alive = [0] * len(fill), total, set(range(len(fill)))
        while left > 0 and alive:
            i = min(alive, key=lambda i: (fill[i] + (counts[i] + unit[i] - 1) * slow[i], i))
            if unit[i] > left:
                alive.discard(i)
                continue
            counts[i] += unit[i]
            left -= unit[i]
        return None if left else counts

    rng = random.Random(5)
    for _ in range(400):
        p = rng.randint(1, 7)
        fill = [float(rng.randint(1, 6)) if rng.random() < 0.5 else rng.uniform(1, 6) for _ in range(p)]
        slow = [float(rng.randint(0, 3)) if rng.random() < 0.5 else rng.uniform(0, 3) for _ in range(p)]
        unit = [1] * p if rng.random() < 0.5 else [rng.randint(1, 4) for _ in range(p)]
        total = rng.randint(0, 60)
        assert shares.batch_shares(fill, slow, unit, total) == plain(fill, slow, unit, total)
    # many microbatches over many pipelines (1024 GPUs: a batch of 1024 rows): the first ones are given below a
    # level at once (shares.below_level), the rest by the heap; ties of equal pipelines and keys on the level
    for _ in range(150):
        p = rng.randint(1, 40)
        kinds = [(rng.uniform(0.5, 4.0), rng.uniform(0.01, 0.5)) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.3:  # integers: keys equal between pipelines and to the level
            kinds = [(float(rng.randint(1, 4)), float(rng.randint(1, 3))) for _ in kinds]
        fill, slow = zip(*(rng.choice(kinds) for _ in range(p)))
        total = rng.randint(0, 2000)
        ones = [1] * p
        counts = shares.batch_shares(list(fill), list(slow), ones, total)
        assert counts == plain(fill, slow, ones, total)
        below = shares.below_level(list(fill), list(slow), total)
        assert sum(below) <= total and (total < 3 * p or sum(below) > 0)  # the level gives most of them


def test_parameter_counts_match_the_models_parameters():
    c = load_cluster(SMALL)
    cost = PlannerCostModel(c)
    for tp in (1, 2):
        for first, last in itertools.product((False, True), repeat=2):
            infos = stage_params(c.model, 2, 5, first, last)
            want = sum(math.prod(i.shape) / (tp if i.shard_dim is not None else 1) for i in infos)
            assert cost.stage_params(tp, 3, first, last) == pytest.approx(want)
    assert sum(math.prod(i.shape) for i in layer_params(c.model, 0)) == sum(cost.layer_params(1))


def test_flops_and_tp_all_reduce_arithmetic():
    c = load_cluster(SMALL)
    cost = PlannerCostModel(c)
    H, F, S, V = 32, 128, 16, 64  # the reference model: swiglu, ffn = 4 * hidden
    assert cost.layer_forward_flops() == S * (8 * H * H + 2 * 3 * H * F) + 2 * S * S * H
    g = TPGroup("fast0", "fast", ("fast0:0", "fast0:1"), c.node("fast0").kind)
    f, b, w, tp = cost.stage_times(g, 2, True, 4, False)
    speed = 2 * 0.01e12
    compute = 4 * (2 * cost.layer_forward_flops() + 2 * S * H * V) / speed
    ring = 2 * (2 - 1) / 2 * (4 * S * H * 4) / (40e9 / 8)  # fp32 activations over a 40 Gbit/s link
    assert tp == pytest.approx(4 * 2 * ring)
    assert f == pytest.approx(compute + 2 * 2 * ring)
    assert b == pytest.approx(2 * compute + 2 * 2 * ring)
    _, b_rc, _, tp_rc = cost.stage_times(g, 2, True, 4, True)
    assert b_rc == pytest.approx(b + 4 * 2 * cost.layer_forward_flops() / speed + 2 * 2 * ring)


def test_gradient_sync_is_zero_for_one_pipeline_and_crosses_domains_when_holders_do():
    c = load_cluster(SMALL)
    cost = PlannerCostModel(c)
    kind_f, kind_s = c.node("fast0").kind, c.node("slow0").kind
    a = TPGroup("fast0", "fast", ("fast0:0",), kind_f)
    b = TPGroup("fast0", "fast", ("fast0:1",), kind_f)
    s0 = TPGroup("slow0", "slow", ("slow0:0",), kind_s)
    one = Candidate((PipelineChoice(8, 2, (StageChoice(a, 8),)),))
    assert cost.grad_sync_time(one) == 0
    same_node = Candidate((PipelineChoice(4, 2, (StageChoice(a, 8),)), PipelineChoice(4, 2, (StageChoice(b, 8),))))
    cross = Candidate((PipelineChoice(4, 2, (StageChoice(a, 8),)), PipelineChoice(4, 2, (StageChoice(s0, 8),))))
    full = cost.stage_params(1, 8, True, True) * 4  # float32 gradient bytes of the whole model
    assert cost.grad_sync_time(same_node) < cost.grad_sync_time(cross)
    assert cost.grad_sync_time(cross) >= full / (5e9 / 8)  # every byte over the 5 Gbit/s cross-domain link


def test_measured_overhead_per_action_and_latency_per_message(tmp_path):
    """[plan] action_overhead_us adds to every compute action (1F1B: F and B per microbatch; ZB-H1: F, I and W;
    interleaved: per chunk), p2p_latency_us to every stage-boundary hop and gradient-ring step."""
    base = load_cluster(SMALL)
    path = small_cluster(
        tmp_path, edit=lambda t: t.replace("[plan]\n", "[plan]\naction_overhead_us = 1000\np2p_latency_us = 300\n", 1)
    )
    c = load_cluster(path)
    assert (c.limits.action_overhead_us, c.limits.p2p_latency_us) == (1000, 300)
    plain, cost = PlannerCostModel(base), PlannerCostModel(c)
    kind_f, kind_s = c.node("fast0").kind, c.node("slow0").kind
    a = TPGroup("fast0", "fast", ("fast0:0",), kind_f)
    b = TPGroup("fast0", "fast", ("fast0:1",), kind_f)
    s0 = TPGroup("slow0", "slow", ("slow0:0",), kind_s)
    for schedule, actions in (("1f1b", 2), ("zbh1", 3)):  # one stage: every action is on the critical path
        one = Candidate((PipelineChoice(8, 4, (StageChoice(a, 8),)),), schedule)
        assert cost.score(one).step_time - plain.score(one).step_time == pytest.approx(4 * actions * 1e-3)
    # two stages: the added time is that of a simulation with every action and hop longer by the constants (two
    # nodes under gloo: a rendezvous link, each message waits for its receive's notice, a hop longer too)
    assert cost.rendezvous(a, s0) and cost.rendezvous(s0, a)
    assert not cost.rendezvous(a, b)  # inside fast0: its CPU ranks' shared-memory ring (cluster.nodes[].p2p = 'auto')
    network = load_cluster(
        small_cluster(tmp_path, edit=lambda t: t.replace('"cpu", "cpu"]', '"cpu", "cpu"]\np2p = "network"'))
    )
    assert PlannerCostModel(network).rendezvous(a, b)
    for schedule, chunks in (("1f1b", 1), ("interleaved", 2)):
        two = Candidate((PipelineChoice(8, 4, (StageChoice(a, 4), StageChoice(s0, 4))),), schedule, chunks)
        times = [plain.stage_times(g, 4, last, 2, False) for g, last in ((a, False), (s0, True))]
        bw, lat = plain.boundary(a, s0, 2)
        acts = pipesim.actions(schedule, 2, 4, chunks)
        lats = (lat + 3e-4,) * (2 if schedule == "interleaved" else 1)
        want, _ = pipesim.simulate(
            acts,
            [t[0] + chunks * 1e-3 for t in times],
            [t[1] + chunks * 1e-3 for t in times],
            None,
            lats,
            (bw,) * len(lats),
            2 * 16 * 32 * 4,
            (True,) * len(lats),
        )
        assert cost.score(two).pipeline_times[0] == pytest.approx(want)
        assert cost.score(two).pipeline_times[0] > plain.score(two).pipeline_times[0]
    dp = Candidate((PipelineChoice(4, 2, (StageChoice(a, 8),)), PipelineChoice(4, 2, (StageChoice(b, 8),))))
    assert cost.grad_sync_time(dp) - plain.grad_sync_time(dp) == pytest.approx(2 * (2 - 1) * 3e-4)  # one bucket


def test_memory_counts_parameter_state_and_activations_in_flight():
    c = load_cluster(SMALL)
    cost = PlannerCostModel(c)
    g = TPGroup("slow0", "slow", ("slow0:0",), c.node("slow0").kind)
    params = cost.stage_params(1, 2, False, False)

    def held(full: float, put_off: float = 0.0, grads: float = 1.0):  # one point: the gradients made, or not yet
        return ((full, put_off, grads),)

    # no activations: weight, gradient and moments (16 B) + the optimizer step's denominator (4 B) per parameter
    assert cost.stage_memory(g, 2, False, False, 1, False, held(0)) == params * 20
    # per token and layer: norms' in/out, Q K V O, SwiGLU's four; the norms' rstd and SDPA's log-sum-exp (2 + 4 heads);
    # RMS norm's two more H-wide tensors; RoPE's halves (H) and tables (head_dim 8)
    elements = 4 * 32 + (4 * 32 + 4 * 128) + 2 + 4 + 2 * 32 + 32 + 8
    one = 2 * 16 * elements * 4  # layers x tokens x elements x fp32
    assert one < params * 4 < 3 * one  # one microbatch in flight needs less than the step's temporary, three more
    assert cost.stage_memory(g, 2, False, False, 1, False, held(1)) == params * 20
    assert cost.stage_memory(g, 2, False, False, 1, False, held(3)) == params * 16 + 3 * one
    assert cost.stage_memory(g, 2, False, False, 1, False, held(5)) == params * 16 + 5 * one
    recompute = 5 * 2 * 16 * 32 * 4 + 16 * elements * 4
    assert cost.stage_memory(g, 2, False, False, 1, True, held(5)) == params * 16 + max(recompute, params * 4)
    # before the step's first backward no gradient exists (the runtime frees them after each step): GPipe's peak
    assert cost.stage_memory(g, 2, False, False, 1, False, held(5, grads=0)) == params * 12 + 5 * one
    both = held(5, grads=0) + held(4)
    assert cost.stage_memory(g, 2, False, False, 1, False, both) == params * 12 + max(5 * one, 4 * one + params * 4)
    # a split backward (ZB-H1) holds each linear layer's input and output gradient until its W (runtime/wgrad.py):
    # per token and layer, inputs H (Q K V's), H (the output projection's), H (the MLP's), F (w2's); gradients of
    # Q K V (3 H), O (H), w1 and w3 (2 F), w2 (H)
    put_off = 2 * 16 * (3 * 32 + 128 + 3 * 32 + 32 + 2 * 128 + 32) * 4
    assert cost.stage_memory(g, 2, False, False, 1, False, held(2, 1, 0)) == params * 12 + 2 * one + put_off


def brute_split(planner: Planner, groups, rows, in_flight):
    k, best = len(groups), (math.inf, None)
    for cuts in itertools.combinations(range(1, planner.L), k - 1):
        split = [b - a for a, b in zip((0,) + cuts, cuts + (planner.L,))]
        t = max(
            planner.stage_cost(g, l, i == 0, i == k - 1, rows, in_flight[i])[0]
            for i, (g, l) in enumerate(zip(groups, split))
        )
        if t < best[0]:
            best = t, tuple(split)
    return best


def test_layer_split_is_the_exact_min_max(tmp_path):
    c = load_cluster(small_cluster(tmp_path, edit=lambda t: t.replace("memory_gb = 8", "memory_gb = 0.0011")))
    planner = Planner(c)
    groups = planner.groups({"cpu2x": 1, "cpu": 1})
    for order in itertools.permutations(groups, 3):
        got = planner.split_layers(tuple(order), 2, "1f1b", 1, 8)
        want = brute_split(planner, order, 2, planner.cost._peaks("1f1b", 3, 8, 1))
        if want[1] is None:
            assert got is None
        else:
            assert got[2] == pytest.approx(want[0]) and sum(got[0]) == planner.L


def test_batch_shares_are_the_min_max_over_every_split():
    c = load_cluster(SMALL)
    planner = Planner(c)
    groups = planner.groups({"cpu2x": 1, "cpu": 1})
    st = Structure(((groups[0], groups[2]), (groups[1],), (groups[3],)), 1)
    cand = planner.realize(st)
    assert sum(p.batch for p in cand.pipelines) == 8
    splits = [planner.split_layers(p, 1, "1f1b", 1, 8) for p in st.pipelines]

    def est(m, s, groups):
        times = [
            planner.stage_cost(g, l, i == 0, i == len(groups) - 1, 1, ONE_IN_FLIGHT)[0]
            for i, (g, l) in enumerate(zip(groups, s[0]))
        ]
        return sum(times) + (m - 1) * s[2] if m else 0.0

    worst = max(est(p.microbatches, s, g) for p, s, g in zip(cand.pipelines, splits, st.pipelines))
    brute = min(
        max(est(m, s, g) for m, s, g in zip(ms, splits, st.pipelines))
        for ms in itertools.product(range(9), repeat=3)
        if sum(ms) == 8
    )
    assert worst == pytest.approx(brute)


def test_tp_groups_stay_in_a_node_and_divide_heads(tmp_path):
    c = load_cluster(
        small_cluster(
            tmp_path,
            edit=lambda t: t.replace('devices = ["cpu", "cpu"]', 'devices = ["cpu", "cpu", "cpu"]').replace(
                "max_tp = 2", "max_tp = 0"
            ),
        )
    )
    planner = Planner(c)
    assert planner.tp_sizes(3) == [1, 2]  # 3 does not divide 4 heads
    groups = planner.groups({"cpu2x": 4, "cpu": 1})
    assert [g.devices for g in groups if g.node == "fast0"] == [("fast0:0", "fast0:1"), ("fast0:2",)]
    result = plan_cluster(c)
    for p in result.best.pipelines:
        for s in p.stages:
            assert len({d.split(":")[0] for d in s.group.devices}) == 1 and 4 % s.group.tp == 0


def test_local_search_moves_never_use_a_device_twice(tmp_path):
    """Pipelines with the same stage kinds move together, but an idle TP group joins one of them only."""
    c = load_cluster(
        small_cluster(
            tmp_path, edit=lambda t: t.replace('name = "slow1"\n', 'name = "slow1"\ndevices = ["cpu", "cpu"]\n')
        )
    )
    planner = Planner(c)
    groups = planner.groups({"cpu2x": 1, "cpu": 1})
    a, b, s0, s1a, _ = groups
    for st in (Structure(((a, s0), (b, s1a)), 1), Structure(((a,), (b,)), 2, "zbh1")):
        moves = list(planner.neighbours(st))
        assert len(moves) > 5
        for nb in moves:
            devices = [d for p in nb.pipelines for g in p for d in g.devices]
            assert len(devices) == len(set(devices)), nb
        assert any(sum(len(p) for p in nb.pipelines) > sum(len(p) for p in st.pipelines) for nb in moves)


def test_plan_is_deterministic_and_never_worse_than_hetero_place():
    c = load_cluster(SMALL)
    a, b = plan_cluster(c), plan_cluster(c)
    assert a.best.key() == b.best.key()
    assert a.seed_score is not None and a.score.step_time <= a.seed_score.step_time
    assert a.score.step_time >= a.score.lower_bound


def test_written_layout_drops_plan_tables_and_sets_the_schedule(tmp_path):
    c = load_cluster(SMALL)
    result = plan_cluster(c)
    text = layout_text(c, result.best, result.score, result.seed_score)
    assert "[plan" not in text and "cpu2x = " not in text
    lay = layout_mod.loads(text, base_dir=SMALL.parent)
    assert lay.train.schedule.value == result.best.schedule
    assert text.startswith("# Planned by hetero-plan")
    assert "PREDICTED" in text and "MFU" in text and "gap" in text


def test_every_ranked_plan_is_a_valid_layout(tmp_path):
    """Not only the pick: every plan the planner ranks loads as a layout (interleaving needs 2 stages, ...)."""
    # its emulated cluster once ranked an interleaved plan with a 1-stage pipeline
    from bench.planner import plan_vs_measured

    (tmp_path / "emulated.toml").write_text(plan_vs_measured.cluster_text(steps=1))
    for path in (SMALL, tmp_path / "emulated.toml"):
        c = load_cluster(path)
        result = plan_cluster(c, top=20)
        assert len(result.ranked) >= 8
        for cand, score in result.ranked:
            layout_mod.loads(layout_text(c, cand, score, None), base_dir=path.parent)


def test_plan_vs_measured_spreads_its_plans_over_the_ranking():
    """bench/planner/plan_vs_measured.py runs the pick, then each plan at least min_gap slower than the last chosen."""
    from bench.planner import plan_vs_measured

    ranking = [1.0, 1.01, 1.02, 1.05, 1.06, 1.09, 1.2]
    assert plan_vs_measured.spread_over_ranking(ranking, 10, 0.03) == [0, 3, 5, 6]
    assert plan_vs_measured.spread_over_ranking(ranking, 2, 0.03) == [0, 3]
    assert plan_vs_measured.spread_over_ranking(ranking, 10, 0.0) == list(range(7))


def test_peaks_in_flight_past_three_times_the_stages_repeat():
    """The memory model reads peaks of a shorter schedule past 3 x stages microbatches (same count modulo the
    stages): checked here against the generated schedules themselves."""
    cost = PlannerCostModel(load_cluster(SMALL))
    for kind, chunks in [("1f1b", 1), ("zbh1", 1), ("interleaved", 2)]:
        for stages in range(2 if kind == "interleaved" else 1, 6):
            for mbs in range(3 * stages + 1, 3 * stages + 2 * stages + 2):
                if kind == "interleaved" and mbs % stages:
                    continue
                # an interleaved (microbatch, chunk) pair holds 1/chunks of the stage's layers
                held = pipesim.held_in_flight(pipesim.actions(kind, stages, mbs, chunks))
                want = tuple(tuple((f / chunks, p / chunks, float(g)) for f, p, g in stage) for stage in held)
                assert cost._peaks(kind, stages, mbs, chunks) == want, (kind, stages, mbs)


@pytest.mark.parametrize("seed,draw,optimum", [(9, 901, 0.06299258314482513), (92, 9200, 0.10537542004843177)])
def test_search_without_enumeration_reaches_the_optimum_several_moves_away(seed, draw, optimum):
    """Two of plan_bench's small clusters whose exhaustive optimum (bench/planner/plan_bench.py's enumerator) the local
    search once missed: seed 9 (1.28x: the batch split left a pipeline empty, and merging two pipelines pays
    only under the interleaved schedule) and seed 92 (1.057x: three moves, each worse alone)."""
    from bench.planner import plan_bench
    from hetero_llm.planner import place_seeds

    c = plan_bench.load(plan_bench._draw_small(draw))  # = plan_bench.small_cluster(seed), without its redraw check
    # the landscape these cases were found on: every kind priced by FLOPs at its peak, links at their line rate
    # (the cost model before the roofline one); under the roofline model draw 901's search lands 0.9% above the
    # exhaustive optimum (0.13518 s vs 0.13400 s) and draw 9200's on it
    c = flops_priced(c)
    result = Planner(c).run(place_seeds(c))
    assert result.score.step_time == pytest.approx(optimum, rel=1e-9)
