"""hetero-plan: cost arithmetic, the search's rules on small cases, bad cluster files, and planned layouts
training the reference model. Single process and torch-free except the one multi-process test."""

from __future__ import annotations

import inspect
import itertools
import json
import math
import random
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers_plan import flops_priced

from harness import LAYOUTS
from hetero_llm import layout as layout_mod
from hetero_llm import schedule as sched
from hetero_llm.cli.plan import main as plan_main
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


def run_plan(*args):
    runner = (
        CliRunner(mix_stderr=False) if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters else CliRunner()
    )
    return runner.invoke(plan_main, [str(a) for a in args])


def small_cluster(tmp_path: Path, plan: str = "", nodes: str = "", edit=None) -> Path:
    text = SMALL.read_text()
    if edit:
        text = edit(text)
    text = text + plan
    if nodes:
        text = text.replace("[plan]\n", nodes + "\n[plan]\n", 1)
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


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
    from bench import plan_vs_measured  # its emulated cluster once ranked an interleaved plan with a 1-stage pipeline

    (tmp_path / "emulated.toml").write_text(plan_vs_measured.cluster_text(steps=1))
    for path in (SMALL, tmp_path / "emulated.toml"):
        c = load_cluster(path)
        result = plan_cluster(c, top=20)
        assert len(result.ranked) >= 8
        for cand, score in result.ranked:
            layout_mod.loads(layout_text(c, cand, score, None), base_dir=path.parent)


def test_plan_vs_measured_spreads_its_plans_over_the_ranking():
    """bench/plan_vs_measured.py runs the pick, then each plan at least min_gap slower than the last chosen."""
    from bench import plan_vs_measured

    ranking = [1.0, 1.01, 1.02, 1.05, 1.06, 1.09, 1.2]
    assert plan_vs_measured.spread_over_ranking(ranking, 10, 0.03) == [0, 3, 5, 6]
    assert plan_vs_measured.spread_over_ranking(ranking, 2, 0.03) == [0, 3]
    assert plan_vs_measured.spread_over_ranking(ranking, 10, 0.0) == list(range(7))


def test_cli_writes_json_and_explains(tmp_path):
    out = tmp_path / "plan.toml"
    res = run_plan(SMALL, "-o", out, "--json", "--top", "2")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert (
        len(data["plans"]) == 2
        and data["plans"][0]["predicted"]["step_time"] <= data["plans"][1]["predicted"]["step_time"]
    )
    res = run_plan(SMALL, "-o", out, "--explain", "--top", "3")
    assert res.exit_code == 0 and "why #1 wins" in res.stdout and "#3" in res.stdout
    assert layout_mod.load(out).pipelines


SCHEDULES = 'schedules = ["1f1b", "zbh1", "interleaved"]\n'

BAD = [
    ("max_tp = 2\n", "max_tp = -1\n", "plan.max_tp: must be >= 0 (0 = a node's device count), got -1"),
    (
        SCHEDULES,
        'schedules = ["1f1b", "pipedream"]\n',
        "plan.schedules[1]: unknown schedule 'pipedream' (the planner chooses from 1f1b, zbh1, interleaved, gpipe)",
    ),
    (
        SCHEDULES,
        'schedules = ["dynamic"]\n',
        "plan.schedules[0]: 'dynamic' runs what is ready at run time: the planner's simulator cannot price it "
        "(plan with '1f1b', then set train.schedule = 'dynamic' in the written layout)",
    ),
    (
        SCHEDULES,
        "schedules = []\n",
        "plan.schedules: needs at least one schedule (from 1f1b, zbh1, interleaved, gpipe)",
    ),
    (
        "[plan]\n",
        '[plan]\noptimizers = ["adamw", "sgd"]\n',
        "plan.optimizers[1]: unknown optimizer 'sgd' (the planner chooses from adamw, adamw_zero1)",
    ),
    (
        "[plan]\n",
        "[plan]\noptimizers = []\n",
        "plan.optimizers: needs at least one optimizer (from adamw, adamw_zero1)",
    ),
    ("[plan]\n", "[plan]\nmemory_margin = 1.5\n", "plan.memory_margin: must be in [0, 1), got 1.5"),
    ("[plan]\n", "[plan]\ntime_budget_s = -2\n", "plan.time_budget_s: must be >= 0 (0 = no limit), got -2"),
    (
        "[plan]\n",
        "[plan]\naction_overhead_us = -5\n",
        "plan.action_overhead_us: must be a number of microseconds >= 0 (0 = none), got -5",
    ),
    (
        "[plan]\n",
        "[plan]\np2p_latency_us = -0.5\n",
        "plan.p2p_latency_us: must be a number of microseconds >= 0 (0 = none), got -0.5",
    ),
    ("max_tp = 2\n", "max_tpp = 2\n", "plan.max_tpp: unknown key 'max_tpp' (did you mean 'max_tp'?)"),
    (
        "[plan.nodes]\n",
        '[plan.nodes]\nslow0 = "h100"\n',
        "plan.nodes.slow0: unknown device kind 'h100' (known: a100-40g, a100-80g, "
        "a6000, cpu, cpu2x, h100-sxm, h200-sxm, rtx3080ti, rtx3090, rtx4090; or add [plan.kinds.h100])",
    ),
    (
        "[plan.nodes]\n",
        '[plan.nodes]\n"gpu*" = "cpu"\n',
        "plan.nodes.gpu*: matches no node (nodes: fast0, slow0, slow1)",
    ),
    (
        "tflops = 0.01\n",
        "tflops = 0.01\nlink_gbs = 3\n",
        "plan.kinds.cpu2x.link_gbs: unknown key 'link_gbs' (did you mean 'link_gbps'?)",
    ),
    ("memory_gb = 8\n", "memory_gb = -8\n", "plan.kinds.cpu2x.memory_gb: must be > 0, got -8"),
    (
        "[plan.nodes]\n",
        "[plan.nics]\nfast0 = 0\n[plan.nodes]\n",
        "plan.nics.fast0: expected a number of NICs >= 1, got 0",
    ),
    (
        "max_tp = 2\n",
        "max_tp = 2\ngrad_bytes = 8\n",
        "plan.grad_bytes: must be 4 (float32 gradients) or 2 (fp16/bf16), got 8",
    ),
    (
        "tflops = 0.01\n",
        "tflops = 0.01\nlaunch_us = -1\n",
        "plan.kinds.cpu2x.launch_us: must be a number of microseconds >= 0, got -1",
    ),
]


@pytest.mark.parametrize("old,new,message", BAD, ids=[b[2].split(":")[0] for b in BAD])
def test_bad_plan_keys(tmp_path, old, new, message):
    assert old in SMALL.read_text()
    path = small_cluster(tmp_path, edit=lambda t: t.replace(old, new, 1))
    res = run_plan(path, "-o", tmp_path / "out.toml")
    assert res.stderr == f"error: {path}: {message}\n" and res.exit_code == 2 and res.stdout == ""
    assert not (tmp_path / "out.toml").exists()


def test_gpu_node_without_a_kind(tmp_path):
    path = small_cluster(
        tmp_path, edit=lambda t: t.replace('name = "slow1"\n', 'name = "slow1"\ndevices = ["cuda:0"]\n')
    )
    res = run_plan(path, "-o", tmp_path / "out.toml")
    assert res.stderr == (
        f"error: {path}: cluster.nodes[2]: node 'slow1' has no device kind (add it to [plan.nodes], "
        'e.g. slow1 = "a100-80g"; kinds: a100-40g, a100-80g, a6000, cpu, cpu2x, h100-sxm, h200-sxm, '
        "rtx3080ti, rtx3090, rtx4090)\n"
    )
    assert res.exit_code == 2


def test_bad_flags_and_files(tmp_path):
    res = run_plan(SMALL, "-o", tmp_path / "o.toml", "--top", "0")
    assert res.stderr == f"error: {SMALL}: --top: must be >= 1, got 0\n" and res.exit_code == 2
    res = run_plan(tmp_path / "none.toml", "-o", tmp_path / "o.toml")
    assert (
        res.stderr == f"error: {tmp_path / 'none.toml'}: no such file (pass a TOML file with [model], [train] and "
        "[cluster])\n"
    )
    lay = LAYOUTS / "reference" / "hexiscale.toml"
    res = run_plan(lay, "-o", tmp_path / "o.toml")
    assert (
        res.stderr == f"error: {lay}: pipelines: the file already has [[pipelines]] (the planner writes them: "
        "start from a copy without them)\n"
    )


def test_infeasible_cluster_names_the_stage_and_by_how_much(tmp_path):
    path = small_cluster(
        tmp_path,
        edit=lambda t: t.replace("memory_gb = 8", "memory_gb = 0.0001").replace(
            "[plan.nodes]",
            "[plan.kinds.tiny]\ntflops = 0.005\nmemory_gb = 0.0001\nlink_gbps = 40\n"
            'mem_bw_gbs = 10\n[plan.nodes]\n"slow*" = "tiny"',
        ),
    )
    res = run_plan(path, "-o", tmp_path / "out.toml")
    assert res.exit_code == 2 and res.stdout == ""
    line = res.stderr
    assert (
        line.startswith(f"error: {path}: cluster: nothing fits in memory: the closest plan's pipeline ")
        and "GB per device but has 9e-05 GB (" in line
        and line.count("\n") == 1
    )


def test_example_layout_is_the_plan_of_its_cluster_file():
    """layouts/planned/small_cpu.toml is what hetero-plan writes for layouts/clusters/small_cpu.toml (and
    tests/test_invariance.py trains it against layouts/reference/hexiscale.toml, as every example)."""
    c = load_cluster(SMALL)
    result = plan_cluster(c)
    written = (LAYOUTS / "planned" / "small_cpu.toml").read_text()
    assert written == layout_text(c, result.best, result.score, result.seed_score)


def test_planner_doc_lists_every_key():
    from hetero_llm.planner.cluster import schema_markdown

    assert schema_markdown() in (LAYOUTS.parent / "docs" / "planner.md").read_text(), (
        "docs/planner.md is stale: regenerate its tables with python -c 'from hetero_llm.planner.cluster import "
        "schema_markdown; print(schema_markdown())'"
    )


def test_emulated_action_seconds_are_read_per_rank(monkeypatch):
    from hetero_llm.runtime.emulation import Emulation

    monkeypatch.setenv("HETERO_EMULATE_ACTION_S", "0:F=0.02;B=0.04,1:F=0.01;B=0.02;I=0.012;W=0.008")
    from hetero_llm.schedule import Kind

    assert dict(Emulation.from_env(1).seconds) == {Kind.F: 0.01, Kind.B: 0.02, Kind.I: 0.012, Kind.W: 0.008}
    assert Emulation.from_env(0).active and not Emulation.from_env(2).active


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


def write_profile(path: Path, cluster, kinds: dict[str, tuple[float, float, float, float]], **model_edit) -> Path:
    from hetero_llm.planner import profile as prof

    shape = prof.model_shape(cluster.model, cluster.train.precision) | model_edit
    path.write_text(
        json.dumps(
            {"format": prof.FORMAT, "model": shape, "kinds": {k: dict(zip(prof.TIMES, v)) for k, v in kinds.items()}}
        )
    )
    return path


def test_profile_times_replace_peak_flops_for_the_kinds_it_names(tmp_path):
    """Reading a profile is torch-free; a profiled kind's stage times are the measured per-sequence times x
    rows / TP (+ a forward when recomputing), its W the FLOP model's share; other kinds keep peak FLOPS."""
    base = load_cluster(SMALL)
    write_profile(tmp_path / "prof.json", base, {"cpu2x": (1e-3, 2.5e-3, 4e-4, 6e-4)})
    path = small_cluster(tmp_path, plan="", edit=lambda t: t.replace("[plan]\n", '[plan]\nprofile = "prof.json"\n'))
    c = load_cluster(path)
    cost, flop = PlannerCostModel(c), PlannerCostModel(base)
    fast = TPGroup("fast0", "fast", ("fast0:0", "fast0:1"), c.node("fast0").kind)
    slow = TPGroup("slow0", "slow", ("slow0:0",), c.node("slow0").kind)
    f, b, w, _ = cost.stage_times(fast, 3, True, 4, False)
    tp_f, tp_b = flop.stage_times(fast, 3, True, 4, False)[3] / 2, flop.stage_times(fast, 3, True, 4, False)[3] / 2
    assert f - tp_f == pytest.approx(4 / 2 * (3 * 1e-3 + 4e-4))
    assert b - tp_b == pytest.approx(4 / 2 * (3 * 2.5e-3 + 6e-4))
    share = cost.layer_matmul_flops() / (2 * cost.layer_forward_flops())
    assert w == pytest.approx(4 / 2 * (3 * 2.5e-3 * share + 3e-4))
    rc = cost.stage_times(fast, 3, False, 4, True)
    assert rc[1] - cost.stage_times(fast, 3, False, 4, False)[1] == pytest.approx(4 / 2 * 3 * 1e-3 + tp_b)
    assert cost.stage_times(slow, 3, True, 4, False) == flop.stage_times(slow, 3, True, 4, False)
    # --profile-file replaces [plan] profile; the plan is searched under the measured times
    other = write_profile(tmp_path / "other.json", base, {"cpu": (1e-3, 2e-3, 1e-4, 2e-4)})
    assert load_cluster(path, other).profile.get("cpu2x") is None
    res = run_plan(path, "-o", tmp_path / "out.toml", "--profile-file", other)
    assert res.exit_code == 0, res.stderr


BAD_PROFILES = [
    (
        "missing.json",
        None,
        "cannot read profile '{p}': No such file or directory (write one with: hetero-plan {c} --profile {p})",
    ),
    (
        "bad.json",
        "{",
        "profile '{p}' is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
        "(char 1)); write one with: hetero-plan {c} --profile {p}",
    ),
    (
        "fmt.json",
        '{"kinds": {}}',
        "profile '{p}' is not a hetero-plan profile (expected format 'hetero-plan profile 1' "
        "and a 'kinds' table); write one with: hetero-plan {c} --profile {p}",
    ),
    (
        "shape.json",
        {"hidden": 64},
        "profile '{p}' was measured with hidden = 64, the cluster's model has 32; measure "
        "again (write one with: hetero-plan {c} --profile {p})",
    ),
    (
        "neg.json",
        {"cpu": (1e-3, -1.0, 1e-4, 1e-4)},
        "profile '{p}': kinds.cpu.layer_backward_s must be a number of "
        "seconds > 0, got -1.0; write one with: hetero-plan {c} --profile {p}",
    ),
]


@pytest.mark.parametrize("name,content,message", BAD_PROFILES, ids=[b[0] for b in BAD_PROFILES])
@pytest.mark.parametrize("via", ["key", "flag"])
def test_bad_profiles(tmp_path, name, content, message, via):
    base = load_cluster(SMALL)
    p = tmp_path / name
    if isinstance(content, str):
        p.write_text(content)
    elif isinstance(content, dict) and "hidden" in content:
        write_profile(p, base, {"cpu": (1e-3,) * 4}, **content)
    elif content is not None:
        write_profile(p, base, content)
    if via == "key":
        path = small_cluster(tmp_path, edit=lambda t: t.replace("[plan]\n", f'[plan]\nprofile = "{name}"\n'))
        args, where = (), "plan.profile"
    else:
        path, args, where = SMALL, ("--profile-file", p), "--profile-file"
    res = run_plan(path, "-o", tmp_path / "out.toml", *args)
    shown = p if via == "flag" else path.parent / name
    assert res.stderr == f"error: {path}: {where}: " + message.format(p=shown, c=path) + "\n"
    assert res.exit_code == 2 and not (tmp_path / "out.toml").exists()


def test_profile_flag_errors(tmp_path):
    res = run_plan(SMALL)
    assert (
        res.stderr
        == f"error: {SMALL}: -o: missing: name the layout file to write (-o LAYOUT.toml), print the plans with "
        "--explain or --json, or measure with --profile FILE\n"
        and res.exit_code == 2
    )
    res = run_plan(SMALL, "--profile", tmp_path / "p.json", "--device", "cpu")
    assert (
        res.stderr
        == f"error: {SMALL}: --kind: name the device kind to record the times under (nodes on 'cpu' have "
        "kinds ['cpu', 'cpu2x']; the cluster's kinds: cpu, cpu2x)\n"
        and res.exit_code == 2
    )
    res = run_plan(SMALL, "--profile", tmp_path / "p.json", "--kind", "h100-sxm")
    assert res.stderr == f"error: {SMALL}: --kind: no node of the cluster has kind 'h100-sxm' (kinds: cpu, cpu2x)\n"
    (tmp_path / "junk.json").write_text("junk")
    res = run_plan(SMALL, "--profile", tmp_path / "junk.json", "--kind", "cpu", "--device", "cpu")
    assert res.stderr.startswith(f"error: {SMALL}: --profile: '{tmp_path / 'junk.json'}' exists and is not a profile (")
    assert res.exit_code == 2 and not (tmp_path / "p.json").exists()


def test_profile_measures_this_machine_and_the_plan_reads_it(tmp_path):
    """hetero-plan --profile times the library's block and head (torch) and adds kinds to one file, which
    the planner then reads."""
    pytest.importorskip(
        "torch",
        reason="measuring a profile runs the model (reading one does not); runs wherever torch is installed, as in CI",
    )
    out = tmp_path / "p.json"
    for kind in ("cpu", "cpu2x"):  # (a noisy machine's measurement is refused: tests/test_plan_explain.py)
        res = run_plan(SMALL, "--profile", out, "--kind", kind, "--device", "cpu", "--max-spread", "1000")
        assert res.exit_code == 0, res.stderr
        assert res.stdout.startswith(f"profiled kind '{kind}' on cpu (")
    data = json.loads(out.read_text())
    assert set(data["kinds"]) == {"cpu", "cpu2x"} and data["model"]["hidden"] == 32
    c = load_cluster(SMALL, out)
    for kind in ("cpu", "cpu2x"):
        t = c.profile.get(kind)
        assert 0 < t.head_forward_s < 1 and 0 < t.layer_forward_s < 1 and 0 < t.layer_backward_s < 1
    res = run_plan(SMALL, "-o", tmp_path / "o.toml", "--profile-file", out)
    assert res.exit_code == 0, res.stderr


@pytest.mark.parametrize("seed,draw,optimum", [(9, 901, 0.06299258314482513), (92, 9200, 0.10537542004843177)])
def test_search_without_enumeration_reaches_the_optimum_several_moves_away(seed, draw, optimum):
    """Two of plan_bench's small clusters whose exhaustive optimum (bench/plan_bench.py's enumerator) the local
    search once missed: seed 9 (1.28x: the batch split left a pipeline empty, and merging two pipelines pays
    only under the interleaved schedule) and seed 92 (1.057x: three moves, each worse alone)."""
    from bench import plan_bench
    from hetero_llm.planner import place_seeds

    c = plan_bench.load(plan_bench._draw_small(draw))  # = plan_bench.small_cluster(seed), without its redraw check
    # the landscape these cases were found on: every kind priced by FLOPs at its peak, links at their line rate
    # (the cost model before the roofline one); under the roofline model draw 901's search lands 0.9% above the
    # exhaustive optimum (0.13518 s vs 0.13400 s) and draw 9200's on it
    c = flops_priced(c)
    result = Planner(c).run(place_seeds(c))
    assert result.score.step_time == pytest.approx(optimum, rel=1e-9)


def test_profile_applies_only_at_its_shapes(tmp_path):
    """hetero-plan --buckets plans other sequence lengths: a profile measured at the cluster's seq_len is not
    used there (the FLOP model is)."""
    import attrs

    base = load_cluster(SMALL)
    c = load_cluster(SMALL, write_profile(tmp_path / "p.json", base, {"cpu2x": (1e-3, 2e-3, 1e-4, 2e-4)}))
    fast = TPGroup("fast0", "fast", ("fast0:0",), c.node("fast0").kind)
    assert PlannerCostModel(c).stage_times(fast, 2, False, 1, False)[0] == pytest.approx(2e-3)
    shorter = attrs.evolve(c, model=attrs.evolve(c.model, seq_len=8))
    flop = attrs.evolve(base, model=attrs.evolve(base.model, seq_len=8))
    assert PlannerCostModel(shorter).stage_times(fast, 2, False, 1, False) == PlannerCostModel(flop).stage_times(
        fast, 2, False, 1, False
    )
