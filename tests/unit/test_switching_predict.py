"""The simulator's hot-switching step (``predict.simulate_buckets``), the emulated device's action costs
(``action_seconds``, what ``HETERO_EMULATE_DEVICE`` makes compute actions last) and the switch
cost over link kinds (``predict.switch_seconds``). Torch-free, except the runtime's reading of the variable."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest

from harness import assert_one_error_line, invoke_cli
from hetero_llm import layout as layout_mod
from hetero_llm.data import documents, sources
from hetero_llm.model import cp_chunks
from hetero_llm.plan import compile_plan
from hetero_llm.predict.device import EmulatedDevice, action_seconds
from hetero_llm.switching import bucketing, predict
from hetero_llm.switching.transfers import step_switch

ROOT = Path(__file__).resolve().parents[2]
THREE = ROOT / "layouts" / "examples" / "hot_switch.toml"  # DP 4 | TP 2 x DP 2 (gpipe) | home PP 2 x TP 2
TWO = Path(__file__).resolve().parents[1] / "data" / "buckets_two.toml"  # DP 2 | home TP 2
TP23 = Path(__file__).resolve().parents[1] / "data" / "buckets_tp23.toml"  # elastic buckets over 3 devices
DEVICE = EmulatedDevice.parse("gflops=2;tp_gbps=8;tp_latency_us=50")
LINKS = {"local": (0.0, 5e9), "node": (1e-4, 1e9), "domain": (5e-4, 1e8), "cross_domain": (1e-3, 1e7)}


def test_emulated_device_specs_parse_and_bad_ones_name_the_key():
    assert (DEVICE.flops, DEVICE.tp_bandwidth, DEVICE.tp_latency) == pytest.approx((2e9, 1e9, 50e-6))
    assert EmulatedDevice.parse("gflops=1").tp_bandwidth == math.inf
    for spec, words in [
        ("gflops=1;speed=2", "unknown key 'speed'"),
        ("gflops=x", "gflops = 'x' is not a number"),
        ("tp_gbps=1", "gflops > 0 is required"),
        ("gflops=1;tp_gbps=0", "tp_gbps must be > 0"),
        ("gflops=-1", "gflops must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=words):
            EmulatedDevice.parse(spec)


def test_action_seconds_follow_positions_documents_and_tp():
    model = layout_mod.load(THREE).model  # hidden 32, ffn 128, GELU, vocab 64
    h, f = model.hidden, model.ffn_width
    matmul = 8 * h * h + 2 * 2 * h * f  # per position and layer
    one = action_seconds(model, "F", 2, 1, 64, 0, 1, False, DEVICE)
    assert one == pytest.approx(2 * 64 * matmul / 2e9)
    # masked attention: 2 H per unit of the sum of squared document lengths, per layer
    assert action_seconds(model, "F", 2, 1, 64, 1000, 1, False, DEVICE) - one == pytest.approx(2 * 2 * h * 1000 / 2e9)
    assert action_seconds(model, "F", 2, 3, 64, 0, 1, False, DEVICE) == pytest.approx(3 * one)
    head = action_seconds(model, "F", 2, 1, 64, 0, 1, True, DEVICE) - one
    assert head == pytest.approx(2 * 64 * h * model.vocab / 2e9)
    parts = {k: action_seconds(model, k, 2, 1, 64, 500, 1, True, DEVICE) for k in "FBIW"}
    assert parts["B"] == pytest.approx(2 * parts["F"]) and parts["I"] + parts["W"] == pytest.approx(parts["B"])
    # TP 2: half the compute, plus two ring all-reduces per layer of the activations (2 (tp-1)/tp bytes/bw + latency)
    tp2 = action_seconds(model, "F", 2, 1, 64, 0, 2, False, DEVICE)
    assert tp2 == pytest.approx(one / 2 + 2 * 2 * (64 * h * 4 / 1e9 + 50e-6))
    assert action_seconds(model, "W", 2, 1, 64, 0, 2, False, DEVICE) == pytest.approx(
        2 * 64 * matmul / 2e9 / 2
    )  # no all-reduce in a weight gradient


def test_a_recomputing_backward_lasts_one_more_forward_of_its_layers_as_the_planner_charges():
    model = layout_mod.load(THREE).model
    for tp in (1, 2):
        layer_f = action_seconds(model, "F", 2, 2, 64, 900, tp, False, DEVICE)  # the blocks' forward, TP included
        for head in (False, True):
            for kind in ("B", "I"):  # a split backward recomputes in its input-gradient part
                plain = action_seconds(model, kind, 2, 2, 64, 900, tp, head, DEVICE)
                again = action_seconds(model, kind, 2, 2, 64, 900, tp, head, DEVICE, recompute=True)
                assert again - plain == pytest.approx(layer_f)  # not the head: it is not recomputed
            for kind in ("F", "W"):
                assert action_seconds(model, kind, 2, 2, 64, 900, tp, head, DEVICE, recompute=True) == (
                    action_seconds(model, kind, 2, 2, 64, 900, tp, head, DEVICE)
                )
    # the same extra the planner's cost model charges a recomputing stage (its backward minus the plain one's)
    from hetero_llm.planner.candidates import TPGroup
    from hetero_llm.planner.cluster import load_cluster
    from hetero_llm.planner.cost import PlannerCostModel

    cluster = load_cluster(ROOT / "layouts" / "clusters" / "small_cpu.toml")
    cost = PlannerCostModel(cluster)
    node = cluster.nodes[0]
    group = TPGroup(node.name, node.domain, tuple(f"{node.name}:{i}" for i in range(2)), node.kind)
    plain, again = (cost.stage_times(group, 3, True, 2, rc)[1] for rc in (False, True))
    f = cost.stage_times(group, 3, False, 2, False)[0]
    assert again - plain == pytest.approx(f)


def test_the_runtime_makes_a_recomputing_stages_backward_last_one_more_forward():
    pytest.importorskip("torch", reason="the runtime needs torch; runs wherever torch is installed, as in CI")
    from types import SimpleNamespace

    import numpy as np

    from hetero_llm.runtime.interpreter import StageRunner
    from hetero_llm.schedule import Action, Kind

    plan = compile_plan(layout_mod.load(TWO))
    stage = plan.stage_of(0)
    inputs = np.zeros((2, 48), dtype=np.int64)
    mb = SimpleNamespace(inputs=inputs, docs=None, ctx=None)
    seconds = {}
    for rc in (False, True):
        runner = SimpleNamespace(
            _step=SimpleNamespace(mbs=[mb]),  # the step running
            stage=stage,
            model=plan.layout.model,
            emulation=SimpleNamespace(device=DEVICE),
            compute=SimpleNamespace(recompute=rc),
        )
        seconds[rc] = {k: StageRunner._modelled_seconds(runner, Action(k, 0)) for k in (Kind.F, Kind.B)}
    lo, hi, _, _ = stage.chunk_shape(0)
    layer_f = action_seconds(plan.layout.model, "F", hi - lo, 2, 48, 2 * 48 * 48, stage.tp, False, DEVICE)
    assert seconds[True][Kind.F] == seconds[False][Kind.F]
    assert seconds[True][Kind.B] - seconds[False][Kind.B] == pytest.approx(layer_f) and layer_f > 0


def test_switch_seconds_charges_local_copies_blocks_and_buffers():
    lay = layout_mod.load(THREE)
    home = compile_plan(lay)
    b0, b1, _ = home.buckets
    for source, target in [(home, b0), (b0, b1), (b1, home)]:
        sw = step_switch(home, source, target, params=target is not home, grads=source is not home)
        same = {k: (1e-4, 1e9) for k in LINKS}
        base = predict.switch_seconds(sw, same)
        assert base < predict.switch_seconds(sw, same, 5e9)  # local copies cost
        assert base < predict.switch_seconds(sw, same, math.inf, 3e-6)  # so does each block
        if sw.grad_buffers:
            assert base < predict.switch_seconds(sw, same, math.inf, 0.0, 2e-5)  # and each gradient buffer


def test_switch_seconds_price_each_link_kind_apart():
    """Two nodes: a transfer across them is priced at the domain link, one inside a node at the node link."""
    lay = layout_mod.load(THREE)
    home = compile_plan(lay)
    b0, _, _ = home.buckets
    sw = step_switch(home, home, b0, params=True, grads=False)
    assert set(sw.link_of[k] for k in sw.messages()) == {"node"}  # one node in this layout
    slow_domain = {**LINKS, "domain": (1.0, 1.0)}
    assert predict.switch_seconds(sw, slow_domain) == predict.switch_seconds(sw, LINKS)  # no domain traffic
    slow_node = {**LINKS, "node": (1e-4, 1e6)}
    assert predict.switch_seconds(sw, slow_node) > 10 * predict.switch_seconds(sw, LINKS)


def test_a_bucketed_step_is_its_buckets_schedules_and_its_switches():
    lay = layout_mod.load(THREE)
    result = predict.simulate_buckets(lay, 0, DEVICE, LINKS)
    assert len(result.buckets) == 3 and all(b is not None and b > 0 for b in result.buckets)
    # home -> b0 -> b1 -> bucket 2, which is the home layout: no switch after it
    assert [(a, b) for a, b, _ in result.switches] == [("home", "b0"), ("b0", "b1"), ("b1", "home")]
    assert result.home_sync == 0.0  # one home pipeline: nothing to all-reduce across pipelines
    assert result.total == pytest.approx(sum(result.buckets) + sum(s for _, _, s in result.switches))
    home = compile_plan(lay)
    plans = home.buckets
    first = step_switch(home, home, plans[0], params=True, grads=False)
    assert result.switches[0][2] == predict.switch_seconds(first, LINKS)


def test_a_one_stage_bucket_takes_the_sum_of_its_microbatches_actions():
    """Bucket 0 of the two-bucket layout: DP 2, one stage per pipeline: its time is the slower pipeline's
    forwards and backwards, each microbatch's from its own rows and documents."""
    lay = layout_mod.load(TWO)
    source = sources.make_document_source(lay.data, lay.model.seq_len, lay.file)
    docs = documents.fill_documents(source, lay.train.seed, 0, lay.train.global_batch, lay.model.seq_len)
    rows = bucketing.bucket_rows(lay, docs)[0]
    half = rows.num_rows // 2
    expected = 0.0
    for piece in (rows.take(0, half), rows.take(half, rows.num_rows)):
        square = int((piece.spans[:, 2] ** 2).sum())
        expected = max(
            expected,
            sum(
                action_seconds(
                    lay.model, k, lay.model.layers, piece.num_rows, lay.buckets[0].max_len, square, 1, True, DEVICE
                )
                for k in "FB"
            ),
        )
    assert predict.simulate_buckets(lay, 0, DEVICE, LINKS).buckets[0] == pytest.approx(expected)


def test_an_elastic_bucket_splits_its_rows_into_more_microbatches_of_fixed_rows():
    """``bucketing.bucket_split``: 12 rows over shares 2 + 1 (4 rounds): fixed, each pipeline keeps its microbatch
    count and their rows grow; elastic, their rows stay batch / microbatches and the count grows."""
    pipes = [
        attrs.evolve(p, batch=b, microbatches=m)
        for p, (b, m) in zip(layout_mod.load(TP23).buckets[0].pipelines, [(2, 2), (1, 1)])
    ]
    assert bucketing.bucket_split(pipes, 12, elastic=False) == (4, [(0, 8, 2), (8, 4, 1)])
    assert bucketing.bucket_split(pipes, 12, elastic=True) == (4, [(0, 8, 8), (8, 4, 4)])
    with pytest.raises(ValueError, match="not a multiple of the pipelines' batch shares"):
        bucketing.bucket_split(pipes, 10, elastic=True)


def test_top_up_fills_a_longer_buckets_free_positions_with_the_longest_shorter_documents_that_fit():
    """TWO: bucket 0 takes documents of up to 12 positions (rows of 12), bucket 1 up to 32 (rows of 32). The long
    documents (31 and 20 positions) leave 1 and 12 positions free: with top_up, bucket 1 takes the 10-position
    document (into the 12) and the 1-position one (the other row), no new row; the 8 and 5 stay in bucket 0,
    packed anew into 2 rows (3 without top-up)."""
    import numpy as np

    docs = [np.arange(n + 1) % 7 for n in (8, 31, 1, 10, 20, 5)]  # positions, in step order
    spans = lambda rows: sorted(int(n) for n in rows.spans[:, 2])  # noqa: E731
    plain = bucketing.bucket_rows(layout_mod.load(TWO), docs)
    assert spans(plain[0]) == [1, 5, 8, 10] and spans(plain[1]) == [20, 31] and plain[0].num_rows == 4
    topped = bucketing.bucket_rows(layout_mod.load(TWO, ["buckets.1.top_up=true"]), docs)
    assert spans(topped[1]) == [1, 10, 20, 31] and spans(topped[0]) == [5, 8]
    assert topped[1].num_rows == plain[1].num_rows and topped[0].num_rows == 2
    rows = {r: sorted(int(n) for rr, _, n in topped[1].spans if rr == r) for r in range(2)}
    assert rows == {0: [1, 31], 1: [10, 20]}
    for rows in topped:  # every position a document's: its own tokens, positions restarting at 0
        for r, start, n in rows.spans:
            assert list(rows.positions[r, start : start + n]) == list(range(n))


def test_an_elastic_two_stage_bucket_is_predicted_with_the_steps_microbatch_count():
    """TP23's bucket 2 (interleaved, 2 stages of 2 chunks) needs 2 rounds of its share in step 1: elastic, it runs
    4 microbatches of one row, whose smaller bubble the simulator sees ((4 + 1/2) rows' time against
    (2 + 1/2) x 2 for 2 microbatches of two, when compute dominates)."""
    elastic = layout_mod.load(TP23)
    fixed = layout_mod.load(TP23, [f"buckets.{i}.elastic=false" for i in range(3)])
    assert [b.elastic for b in elastic.buckets] == [True] * 3
    e, f = (predict.simulate_buckets(lay, 0, DEVICE, LINKS).buckets[2] for lay in (elastic, fixed))
    assert e < 0.95 * f


def test_home_sync_is_a_ring_all_reduce_across_home_pipelines():
    lay = layout_mod.load(THREE)
    two_home = attrs.evolve(lay, pipelines=lay.buckets[1].pipelines)  # TP 2 x DP 2 as the home layout
    result = predict.simulate_buckets(two_home, 0, DEVICE, LINKS)
    per_device = sum(info_size(i, lo, hi) for i, lo, hi in compile_plan(two_home).params_of(0)) * 4
    assert result.home_sync == pytest.approx(per_device / 1e9 + 2 * 1e-4)  # 2 (n-1)/n bytes/bw + 2 (n-1) latency


def info_size(info, lo: int, hi: int) -> int:
    dim = info.shard_dim or 0
    return math.prod(info.shape) // info.shape[dim] * (hi - lo)


def test_dry_run_shows_the_simulated_step_and_refuses_a_bad_device(monkeypatch):
    monkeypatch.setenv("HETERO_EMULATE_DEVICE", "*:gflops=2;tp_gbps=8")
    result = invoke_cli(THREE, "--dry-run")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "simulated step 1 (its documents; devices of 2 GFLOP/s, TP links 8 Gbit/s" in out
    for line in ("  bucket 0: ", "  switch home -> b0: ", "  switch b1 -> home: ", "  home gradient sync: "):
        assert line in out
    monkeypatch.setenv("HETERO_EMULATE_DEVICE", "*:gflops=2;speed=3")
    assert_one_error_line(
        invoke_cli(THREE, "--dry-run"),
        "environment: HETERO_EMULATE_DEVICE: '*:gflops=2;speed=3': emulated device: unknown key "
        "'speed' (known: gflops, tp_gbps, tp_latency_us) (write RANK:VALUE entries separated by "
        "commas, RANK a rank or '*', e.g. '*:gflops=100;tp_gbps=200;tp_latency_us=5')",
    )


def test_the_runtime_reads_an_emulated_device_per_rank(monkeypatch):
    pytest.importorskip("torch", reason="the runtime needs torch; runs wherever torch is installed, as in CI")
    from hetero_llm.runtime.emulation import Emulation

    monkeypatch.setenv("HETERO_EMULATE_DEVICE", "1:gflops=3,*:gflops=2;tp_gbps=8;tp_latency_us=50")
    assert Emulation.from_env(0).device == DEVICE
    assert Emulation.from_env(1).device == DEVICE  # the later entry for every rank wins, as for the other variables
    monkeypatch.setenv("HETERO_EMULATE_DEVICE", "1:gflops=3")
    assert Emulation.from_env(1).device.flops == 3e9 and Emulation.from_env(1).active
    assert not Emulation.from_env(0).active


def test_a_context_parallel_stage_is_priced_at_its_columns_and_its_slowest_ranks_attention(tmp_path):
    """layouts/examples/context_parallel.toml as one bucket (as bench/hot_switch prices a static layout): each stage
    has cp 2, so a rank runs T / 2 columns of every row and its share of the rows' attention; the simulated step
    is made of what the slowest CP rank's actions last, as the emulated devices pace them (the runtime's
    ``_modelled_seconds``), not of the whole rows' (which charged cp 2 about twice: 2.11 s where 1.59 s was
    measured and the planner said 1.13 s, docs/benchmarks.md)."""
    text = (ROOT / "layouts" / "examples" / "context_parallel.toml").read_text()
    one = tmp_path / "one.toml"
    one.write_text(text.replace('[data]\nkind = "grammar"\n', '[data]\nkind = "grammar"\npacking = "documents"\n'))
    static = layout_mod.load(one)
    layout_mod.dump(attrs.evolve(static, buckets=(layout_mod.BucketSpec(max_len=static.model.seq_len),)), one)
    lay = layout_mod.load(one)
    plan = compile_plan(lay)
    assert {st.cp for st in plan.stages} == {2}
    source = sources.make_document_source(lay.data, lay.model.seq_len, lay.file)
    docs = documents.fill_documents(source, lay.train.seed, 0, lay.train.global_batch, lay.model.seq_len)
    rows = bucketing.bucket_rows(lay, docs)[0]
    width, pieces = lay.model.seq_len, rows.share(0, rows.num_rows, lay.pipelines[0].microbatches)
    columns, rows_whole = [], []  # each stage's forwards and backwards over the step, priced both ways
    for st in plan.stages:
        lo, hi, _, head = st.chunk_shape(0)
        mine = theirs = 0.0
        for piece in pieces:
            whole = int((piece.spans[:, 2] ** 2).sum())
            slowest = max(cp_chunks.attention_shares(piece.spans, piece.num_rows, width, 2))
            assert whole / 2 <= slowest < whole  # zigzag balances the rows, their documents not quite
            for k in "FB":
                mine += action_seconds(lay.model, k, hi - lo, piece.num_rows, width // 2, slowest, st.tp, head, DEVICE)
                theirs += action_seconds(lay.model, k, hi - lo, piece.num_rows, width, whole, st.tp, head, DEVICE)
        columns.append(mine)
        rows_whole.append(theirs)
    got = predict.simulate_buckets(lay, 0, DEVICE, LINKS).buckets[0]
    # the busiest stage's actions at least, the stages one after another at most (with the sends between them);
    # priced over whole rows, the busiest stage alone would outlast the simulated step
    assert max(columns) <= got <= sum(columns) + 0.1 * max(columns)
    assert max(rows_whole) > 1.5 * max(columns) and max(rows_whole) > got
