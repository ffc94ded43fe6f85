"""hetero-plan searches the whole space the layout format runs: device subsets, every schedule of plan.schedules
(gpipe, interleaved with any chunk count), adamw vs adamw_zero1: its moves and what it finds on small clusters.
Whether it reaches the exhaustive reference's optimum on a sample of bench/planner/plan_exhaustive.py's clusters
(an exhaustive enumeration per cluster, seconds each) is tests/integration/test_plan_space_optimum.py. Torch-free,
one process."""

from __future__ import annotations

import functools

import attrs
import pytest
from helpers_plan import flops_priced

from bench.planner import plan_exhaustive
from bench.planner.plan_bench import load
from harness import ROOT
from hetero_llm import layout as layout_mod
from hetero_llm.planner import load_cluster, moves, plan_cluster, with_optimizer
from hetero_llm.planner.candidates import TPGroup
from hetero_llm.planner.output import layout_text
from hetero_llm.planner.search import Planner
from hetero_llm.planner.structure import Structure

# clusters of bench/planner/plan_exhaustive.py whose spaces are small enough for seconds (3 devices of 3 kinds, 2-3
# domains, memory-tight models); the bench runs 200 of them, of 3, 5 and 7 devices
SAMPLE = [1, 2, 3, 5, 7, 9, 11, 12, 13, 14, 16, 19, 22, 24, 27]


def test_reference_enumerates_device_subsets():
    """With ``subsets`` the reference holds the structures of every device subset (nodes left idle, part of a
    node idle), each once; without, every device is used."""
    c = load(plan_exhaustive.draw(SAMPLE[0]))
    pl = Planner(c)
    every = pl.all_structures(10**6)
    subsets = pl.all_structures(10**6, subsets=True)
    assert every is not None and subsets is not None
    assert len({s.key() for s in subsets}) == len(subsets) > len(every)
    devices = c.num_devices
    used = {sum(len(g.devices) for p in s.pipelines for g in p) for s in subsets}
    assert used == set(range(1, devices + 1))
    assert all(sum(len(g.devices) for p in s.pipelines for g in p) == devices for s in every)
    chunks = {s.chunks for s in subsets if s.schedule == "interleaved"}
    assert chunks == set(moves.chunk_counts(c.model.layers))
    assert {s.schedule for s in subsets} == set(c.limits.schedules)


@functools.cache
def interleaving_cluster():
    """plan_exhaustive's cluster 200 priced by FLOPs at peak, ZB-H1 left out: with it, since the layer split
    minimises the step, a ZB-H1 plan over the RTX 4090 group and the A100 node (1/4/7 layers, 0.09855 s) is faster
    than the A100 node alone interleaved x4 (0.09872 s), and its layout puts two nodes' cuda:0 on one host."""
    c = flops_priced(load(plan_exhaustive._draw(200)))
    return attrs.evolve(c, limits=attrs.evolve(c.limits, schedules=tuple(s for s in c.limits.schedules if s != "zbh1")))


@functools.cache
def interleaving_plan():
    """hetero-plan's result for ``interleaving_cluster`` (two tests read it)."""
    return plan_cluster(interleaving_cluster())


def test_search_finds_a_plan_that_leaves_devices_idle_with_more_than_two_chunks():
    """A cluster whose best plan (the reference's: 0.0987 s) runs its A100 node alone, interleaved with 4 chunks:
    two of the search's moves away from where its descents end (drop the RTX 4090 group, interleave x4). Priced
    as when it was found (FLOPs at peak): under the roofline model the optimum of this cluster is another plan.
    Without ZB-H1 (``interleaving_cluster``)."""
    result = interleaving_plan()
    used = {d for p in result.best.pipelines for s in p.stages for d in s.group.devices}
    assert result.best.schedule == "interleaved" and result.best.chunks > 2
    assert used and all(d.startswith("n0:") for d in used)  # the A100 node's devices only


def test_moves_offer_every_allowed_schedule_and_chunk_count():
    c = load(plan_exhaustive._draw(200))
    pl = Planner(c)
    groups = pl.groups({"a100-40g": 1, "a6000": 1, "rtx4090": 1})
    st = Structure((tuple(groups[:3]),), 1, "1f1b")
    got = {
        (n.schedule, n.n_chunks) for n in moves.neighbours(pl, st) if (n.pipelines, n.rows) == (st.pipelines, st.rows)
    }
    assert got == {("zbh1", 1), ("gpipe", 1)} | {("interleaved", k) for k in (2, 3, 4, 6, 12)}
    only = attrs.evolve(c, limits=attrs.evolve(c.limits, schedules=("1f1b", "gpipe")))
    pl = Planner(only)
    assert {n.schedule for n in moves.neighbours(pl, st)} == {"1f1b", "gpipe"}  # and only those


def test_written_layout_carries_the_optimizer_and_chunks(tmp_path):
    """The plan's optimizer and chunk count are what the written layout runs (on the cluster priced as in the test
    above, whose plan interleaves more than two chunks)."""
    c = interleaving_cluster()
    result = interleaving_plan()
    cand = attrs.evolve(result.best, optimizer="adamw_zero1")
    score = Planner(with_optimizer(c, "adamw_zero1")).cost.score(cand)
    text = layout_text(c, cand, score, None)
    path = tmp_path / "plan.toml"
    path.write_text(text)
    lay = layout_mod.load(path)
    assert lay.train.optimizer.value == "adamw_zero1"
    assert (lay.train.schedule.value, lay.train.chunks) == (cand.schedule, cand.chunks)


@functools.cache
def planned_with(optimizers: tuple[str, ...], top: int = 5):
    """plan_exhaustive's cluster ``SAMPLE[1]`` planned with ``plan.optimizers = optimizers`` (the two-optimizer
    case compares itself with the one-optimizer cases' plans: each planned once per process)."""
    c = load(plan_exhaustive.draw(SAMPLE[1]))
    return plan_cluster(attrs.evolve(c, limits=attrs.evolve(c.limits, optimizers=optimizers)), top=top)


@pytest.mark.parametrize("optimizers", [("adamw",), ("adamw_zero1",), ("adamw", "adamw_zero1")])
def test_optimizer_is_chosen_among_plan_optimizers_only(optimizers):
    result = planned_with(optimizers, top=8)
    assert {cand.optimizer for cand, _ in result.ranked} <= set(optimizers)
    assert result.best.optimizer in optimizers
    if len(optimizers) == 2:  # never slower than either optimizer alone
        for o in optimizers:
            alone = planned_with((o,), top=8)
            assert result.score.step_time <= alone.score.step_time * (1 + 1e-9)


def test_recompute_only_pays_to_fit():
    """Why the DP recomputes a stage only where it does not fit without: under the cost model recompute makes
    every stage slower and never bigger (so the cheapest feasible choice per stage is optimal)."""
    c = load(plan_exhaustive._draw(200))
    pl = Planner(c)
    for g in pl.groups({"a100-40g": 2, "a6000": 1, "rtx4090": 2}):
        for layers, first, last, rows, in_flight in [
            (1, True, False, 1, 1),
            (4, False, True, 2, 3),
            (6, True, True, 4, 2),
        ]:
            plain = pl.cost.stage_times(g, layers, last, rows, False)
            rc = pl.cost.stage_times(g, layers, last, rows, True)
            assert rc[0] >= plain[0] and rc[1] > plain[1]
            held = ((in_flight, 0.0, 1.0),)
            mem = [pl.cost.stage_memory(g, layers, first, last, rows, r, held) for r in (False, True)]
            assert mem[1] <= mem[0]


def test_sweep_leaves_each_kind_and_domain_idle():
    """The sweep's idle options: nothing, each kind or domain idle, each kind or domain alone; options that keep
    the same nodes come once (here every node is a kind and a domain of its own)."""
    from hetero_llm.planner import sweep

    c = load(plan_exhaustive._draw(200))
    options = sweep.idle_options(Planner(c))
    assert options[0] is None
    names = [n.name for n in c.nodes]
    assert len({(n.kind.name, n.domain) for n in c.nodes}) == len({n.kind.name for n in c.nodes}) == len(names) == 3

    def kept(drop):
        return frozenset(
            n.name for n in c.nodes if drop is None or ((n.kind.name, n.domain)[drop[0]] == drop[1]) == drop[2]
        )

    sets = [kept(o) for o in options]
    assert len(sets) == len(set(sets))
    every = frozenset(names)
    assert set(sets) == {every} | {every - {x} for x in names} | {frozenset({x}) for x in names}


def test_moves_change_schedule_and_rows_at_once_and_cut_a_pipeline_short():
    c = load(plan_exhaustive.draw(130))
    pl = Planner(c)
    g = pl.groups({"rtx3080ti": 2})
    st = Structure((tuple(g),), 1, "interleaved", 2)
    got = {(nb.pipelines, nb.rows, nb.schedule, nb.n_chunks) for nb in moves.neighbours(pl, st)}
    assert (st.pipelines, 2, "zbh1", 1) in got and (st.pipelines, 2, "interleaved", 4) in got
    assert ((tuple(g[2:]),), 2, "interleaved", 4) in got and ((tuple(g[:2]),), 1, "interleaved", 2) in got
    assert moves.row_steps(6, 2) == [1, 3] and moves.row_steps(12, 4) == [2, 6, 3] and moves.row_steps(8, 8) == [4]


def test_rows_move_reaches_the_next_divisors_of_the_batch():
    assert moves.next_divisors(6, 2) == [3, 1]
    assert moves.next_divisors(6, 6) == [3]
    assert moves.next_divisors(12, 4) == [6, 3]
    c = load(plan_exhaustive.draw(151))
    pl = Planner(c)
    g = pl.groups({})
    st = Structure(((g[0], g[2]),), 2, "zbh1")
    assert {nb.rows for nb in moves.neighbours(pl, st)} >= {1, 3}


def test_node_swap_exchanges_which_node_hosts_the_tp_group():
    c = load(plan_exhaustive.draw(79))
    pl = Planner(c)
    n = {node.name: node for node in c.nodes}
    tp = [node.name for node in c.nodes if node.devices == 2]
    a, b = tp
    group = lambda name, *ix: TPGroup(name, n[name].domain, tuple(f"{name}:{i}" for i in ix), n[name].kind)  # noqa: E731
    st = Structure(((group(a, 0, 1), group(b, 0), group(b, 1)),), 1)
    swapped = Structure(((group(b, 0, 1), group(a, 0), group(a, 1)),), 1)
    assert [(x.name, y.name) for x, y in moves.node_swaps(pl, st)] == [(a, b)]
    assert swapped.key() in {nb.key() for nb in moves.neighbours(pl, st)}


def test_a_halved_group_goes_to_any_place_of_another_pipeline():
    """One move halves a TP group and puts the second half at each place of another pipeline."""
    c = load_cluster(ROOT / "layouts" / "clusters" / "hexiscale_40gpu.toml")
    nodes = {n.name: n for n in c.nodes}

    def group(name: str, *ix: int) -> TPGroup:
        return TPGroup(name, nodes[name].domain, tuple(f"{name}:{i}" for i in ix), nodes[name].kind)

    other = (group("r4090a", 0, 1), group("r4090b", 0, 1), group("r4090c", 0, 1))
    st = Structure(((group("r3090", 0, 1, 2, 3), group("ti0", 0, 1, 2, 3)), other), 1, "zbh1")
    keys = {nb.key() for nb in moves.neighbours(Planner(c), st)}
    for at in range(len(other) + 1):
        placed = other[:at] + (group("ti0", 2, 3),) + other[at:]
        assert Structure(((group("r3090", 0, 1, 2, 3), group("ti0", 0, 1)), placed), 1, "zbh1").key() in keys
