"""``hetero-plan --buckets``: a layout per document-length bucket (hetero_llm/switching/propose.py). Torch-free."""

from __future__ import annotations

import json

import attrs
import pytest
from helpers_plan import cluster, run_plan

from hetero_llm import layout as layout_mod
from hetero_llm.planner import buckets, load_cluster, plan_cluster
from hetero_llm.planner.memory import MemoryModel
from hetero_llm.planner.search import Planner
from hetero_llm.switching import propose, worth


def test_short_documents_get_their_own_layout_where_whole_steps_are_predicted_faster(tmp_path):
    """Rows of 1024 must be spread over devices to fit 9 MB; rows of 128 need not: their bucket gets its own plan,
    predicted faster on its rows than the home layout; the long documents run under home's stages as an elastic
    bucket (a step pads them to its few rows, not to the global batch). Priced as whole steps, switches and shard
    copies included, that beats the best static plan, so the buckets are written, and the layout loads."""
    path = cluster(tmp_path, memory_gb=0.009)
    # without interleaving, whose bucket would not be elastic (the written bucket's elasticity is checked below)
    text = path.read_text()
    assert '"zbh1", "interleaved"]' in text
    path.write_text(text.replace('"zbh1", "interleaved"]', '"zbh1"]'))
    out = tmp_path / "out.toml"
    res = run_plan(path, "-o", out, "--buckets", "128")
    assert res.exit_code == 0, res.stderr
    assert "  => writing the buckets kept" in res.stdout
    lay = layout_mod.load(out)
    assert [b.max_len for b in lay.buckets] == [128, 1024]
    home_devices = {d for p in lay.pipelines for s in p.stages for d in s.devices}
    assert {d for p in lay.buckets[0].pipelines for s in p.stages for d in s.devices} <= home_devices
    # the longest bucket: home's stages, fewer rows per round than the global batch, elastic
    stages = lambda pipes: [[(s.layers, s.devices) for s in p.stages] for p in pipes]  # noqa: E731
    assert stages(lay.buckets[1].pipelines) == stages(lay.pipelines) and lay.buckets[1].elastic
    assert sum(p.batch for p in lay.buckets[1].pipelines) < lay.train.global_batch
    # the bucket's plan beats the home layout on its rows by the margin propose asks for
    c = load_cluster(path)
    result = plan_cluster(c, top=1)
    proposed = propose.propose(c, (128, 1024), result.best)
    shorter = Planner(_at(c, 128)).evaluate(result.best)  # home on the global batch's rows of 128
    rows = propose.demand(c, (128, 1024))
    assert proposed[0].plan is not None and sum(p.batch for p in proposed[0].plan.pipelines) == rows[0]
    own_row = worth.pipe_seconds(proposed[0].score) / rows[0]
    assert own_row * propose.MIN_GAIN <= worth.pipe_seconds(shorter) / c.train.global_batch
    # the whole step, priced: faster than the static plan, switches counted, the copies of both bucket layouts
    verdict = worth.judge(c, result.best, result.score, proposed)
    kept = verdict.chosen
    assert verdict.switching and kept.step_s * worth.MIN_GAIN <= verdict.static_s == result.score.step_time
    # the same buckets, asked for a gain just over the one predicted: inside the cost model's margin, not written
    with pytest.MonkeyPatch.context() as mp:
        asked = verdict.static_s / kept.step_s * 1.001
        mp.setattr(worth, "MIN_GAIN", asked)
        within = worth.judge(c, result.best, result.score, proposed)
    assert not within.switching and within.chosen.step_s == pytest.approx(kept.step_s)
    assert all(b.plan is None for b in within.buckets)  # each proposed bucket with a plan says why it is not kept
    assert [b.why_home for b, p in zip(within.buckets, proposed) if p.plan is not None] == [
        f"home layout: whole steps with switching are not predicted {asked:g}x faster than the best static "
        f"plan ({within.chosen.step_s:.4g} s vs {verdict.static_s:.4g} s)"
    ] * sum(p.plan is not None for p in proposed)
    assert kept.switch_s > 0 and kept.step_s == pytest.approx(kept.compute_s + kept.switch_s + kept.home_s)
    # one shared buffer per device for the bucket layouts' shards: the largest, not a copy per layout (every layout
    # with a plan of its own has its views in it, home's stages as an elastic bucket too: the runtime's storage)
    mm = MemoryModel(c)
    copies: dict[str, list[float]] = {}
    for b in kept.buckets:
        for p in b.plan.pipelines if b.plan is not None else ():
            for i, st in enumerate(p.stages):
                for d in st.group.devices:
                    n = mm.stage_params(st.group.tp, st.layers, i == 0, i == len(p.stages) - 1)
                    copies.setdefault(d, []).append(4 * n)
    assert sum(len(c) > 1 for c in copies.values()) > 0  # some device holds two layouts' shards: one buffer for both
    assert kept.copy_bytes == pytest.approx(max(max(c) for c in copies.values()))
    # written elastic (ZB-H1 or 1F1B, every pipeline with at least as many microbatches as stages)
    assert lay.buckets[0].elastic and not lay.buckets[0].top_up and lay.buckets[1].top_up


def test_buckets_planned_beside_home_are_counted_as_the_runtime_holds_them(tmp_path):
    """Each bucket is searched on the memory home's storage leaves (``propose.beside_home``) and counted as held: one
    float32 buffer for every bucket layout's shards (the largest; a layout on home's stages too), held all step as
    the runtime's ``Switcher.storage`` is, beside that layout's gradients. At 6 MB (AdamW only) that fits every
    device and pays; at 5.5 MB it does not fit and the static layout is written, the device over its memory named."""
    tight = cluster(tmp_path, memory_gb=0.0055)
    tight.write_text(tight.read_text().replace("[plan]\n", '[plan]\noptimizers = ["adamw"]\n'))
    res = run_plan(tight, "--buckets", "128", "-o", tmp_path / "tight.toml")
    assert res.exit_code == 0, res.stderr
    assert "do not fit (" in res.stdout and "writing the static layout" in res.stdout
    assert not layout_mod.load(tmp_path / "tight.toml").buckets
    path, out = cluster(tmp_path, memory_gb=0.006), tmp_path / "out.toml"
    path.write_text(path.read_text().replace("[plan]\n", '[plan]\noptimizers = ["adamw"]\n'))
    res = run_plan(path, "-o", out, "--buckets", "128")
    assert res.exit_code == 0, res.stderr
    assert "do not fit" not in res.stdout and "  => writing the buckets kept" in res.stdout
    assert [b.max_len for b in layout_mod.load(out).buckets] == [128, 1024]
    verdict = json.loads(run_plan(path, "--json", "--buckets", "128").stdout)["buckets"]
    assert verdict["switching"] and verdict["kept"]["over_memory"] is None
    c = load_cluster(path)
    home = plan_cluster(c, top=1).best
    room = propose.beside_home(c, home)
    resident = worth.home_resident(c, home)
    for n, m in zip(c.nodes, room.nodes):  # a bucket's search gets what home's storage leaves on each device
        for d, kept in resident.items():
            if d.partition(":")[0] == n.name:
                assert m.kind.memory_gb * 1e9 <= n.kind.memory_gb * 1e9 - kept + 1e-3 < n.kind.memory_gb * 1e9


def test_switches_are_priced_slow_links_drop_the_bucket_whose_switches_cross_the_network(tmp_path, monkeypatch):
    """The same plans as the first test, with every network message of a switch 0.1 s: the short bucket's own
    plan (its switches cross the network) costs more than it saves and is dropped for home's stages as an elastic
    bucket, which switches by local copies only (since issue 33's memory model; before, for the home layout)."""
    path = cluster(tmp_path, memory_gb=0.009)
    path.write_text(path.read_text().replace('"zbh1", "interleaved"]', '"zbh1"]'))  # as the first test
    c = load_cluster(path)
    result = plan_cluster(c, top=1)
    proposed = propose.propose(c, (128, 1024), result.best)
    fast = worth.judge(c, result.best, result.score, proposed)
    slow_links = {k: (0.1, 1e9) for k in ("local", "node", "domain", "cross_domain")}
    monkeypatch.setattr(worth._Pricer, "_links", lambda self, lay: slow_links)
    slow = worth.judge(c, result.best, result.score, proposed)
    stages = lambda cand: [[(s.group, s.layers) for s in p.stages] for p in cand.pipelines]  # noqa: E731
    assert fast.buckets[0].plan is not None and stages(fast.buckets[0].plan) != stages(result.best)
    # slow links: the short bucket runs on home's stages instead (an elastic bucket: its switches copy locally)
    assert slow.buckets[0].plan is not None and stages(slow.buckets[0].plan) == stages(result.best)
    assert slow.proposed.switch_s > 0.2 > slow.chosen.switch_s


def test_elastic_only_where_a_stage_holds_no_more_than_planned():
    """1F1B and ZB-H1 hold at most the stage count of microbatches per stage: elastic once every pipeline was
    planned with that many; GPipe (every microbatch) and interleaved never."""
    from hetero_llm.planner.candidates import Candidate, PipelineChoice, StageChoice

    stage = StageChoice(group=None, layers=4)  # the group plays no part in the rule
    two = PipelineChoice(batch=8, microbatches=4, stages=(stage, stage))
    one = PipelineChoice(batch=6, microbatches=6, stages=(stage,))
    cand = Candidate(pipelines=(two, one), schedule="1f1b")
    assert buckets.elastic_unit(cand) == 2  # gcd(4, 6): shares 4 + 3 rows, 2 + 3 microbatches
    assert buckets.elastic_unit(Candidate(pipelines=(two, one), schedule="zbh1")) == 2
    assert buckets.elastic_unit(Candidate(pipelines=(two, one), schedule="gpipe")) is None
    assert buckets.elastic_unit(Candidate(pipelines=(two, one), schedule="interleaved", chunks=2)) is None
    short = PipelineChoice(batch=1, microbatches=1, stages=(stage, stage))  # 1 microbatch, 2 stages
    assert buckets.elastic_unit(Candidate(pipelines=(short, one), schedule="1f1b")) is None


def _home(c):
    from hetero_llm.planner import plan_cluster

    return plan_cluster(c, top=1).best


def _at(c, seq_len):
    import attrs

    return attrs.evolve(c, model=attrs.evolve(c.model, seq_len=seq_len))


def test_a_bucket_no_faster_than_home_runs_under_the_home_layout(tmp_path):
    out = tmp_path / "out.toml"
    res = run_plan(cluster(tmp_path, seq_len=64), "-o", out, "--buckets", "16,64")  # seq_len itself may be given
    assert res.exit_code == 0, res.stderr
    lay = layout_mod.load(out)
    assert lay.buckets == ()  # no bucket pays: the static layout
    assert (
        "  => switching is not predicted to pay (under 1.05x the static plan, the cost model's margin): writing the static layout (no [[buckets]])"
        in res.stdout
    )


@pytest.mark.parametrize(
    "value, message",
    [
        ("12x", "'12x' is not a comma-separated list of whole numbers (e.g. --buckets 128,512)"),
        (",", "is empty: give the bucket bounds, e.g. --buckets 128,512"),
        ("256,128", "bounds must ascend strictly, got 256 then 128"),
        ("128,2048", "bound 2048 is outside 1..1023 (the last bucket is model.seq_len = 1024, the home layout's)"),
        ("0", "bound 0 is outside 1..1023 (the last bucket is model.seq_len = 1024, the home layout's)"),
    ],
)
def test_bad_bounds_are_one_line_before_any_search(tmp_path, value, message):
    path, out = cluster(tmp_path), tmp_path / "out.toml"
    res = run_plan(path, "-o", out, "--buckets", value)
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr == f"error: {path}: --buckets: {message}\n"
    assert not out.exists()


def test_buckets_need_packed_documents(tmp_path):
    path, out = cluster(tmp_path, packing=False), tmp_path / "out.toml"
    res = run_plan(path, "-o", out, "--buckets", "128")
    assert res.exit_code == 2
    assert res.stderr == (
        f"error: {path}: data.packing: --buckets sorts whole documents by length: set "
        'data.packing = "documents" in the cluster file\n'
    )


def test_a_bucket_is_priced_by_its_own_plan_at_its_own_rows_and_documents(tmp_path):
    """Issue 36: a bucket's compute is its plan evaluated on the rows its step's documents fill (an elastic bucket:
    its shares and microbatches ``rounds`` times; a fixed one: its microbatches ``rounds`` times the rows), with the
    attention of its own documents, not the plan's time for the global batch scaled by rows."""
    from hetero_llm.data.documents import pack_placed
    from hetero_llm.planner.candidates import Candidate, PipelineChoice, StageChoice

    stage = StageChoice(group=None, layers=4)
    plan = Candidate(pipelines=(PipelineChoice(4, 2, (stage, stage)), PipelineChoice(2, 2, (stage,))), schedule="1f1b")
    assert worth.rows_plan(plan, 6, elastic=True) is plan
    tripled = worth.rows_plan(plan, 18, elastic=True)
    assert [(p.batch, p.microbatches) for p in tripled.pipelines] == [(12, 6), (6, 6)]
    assert [(p.batch, p.microbatches) for p in worth.rows_plan(plan, 18, elastic=False).pipelines] == [(12, 2), (6, 2)]
    with pytest.raises(ValueError, match="not a multiple"):
        worth.rows_plan(plan, 7, elastic=True)

    import numpy as np

    path = cluster(tmp_path, seq_len=64)
    whole_rows = load_cluster(path)  # no [plan.documents]: attention over the whole row, S^2, whatever the documents
    path.write_text(path.read_text() + '\n[plan.documents]\ndistribution = "lognormal"\nmedian = 16\nsigma = 1.0\n')
    c = load_cluster(path)
    home = plan_cluster(c, top=1).best
    prices = worth._Pricer(c, home, Planner(c).evaluate(home))

    def rows_of(lengths, rows):  # documents of these token counts, one a row, padded to ``rows`` rows
        docs = [np.zeros(n, dtype=np.int64) for n in lengths]
        return pack_placed(docs, list(range(len(docs))), rows, 64)

    under_home = buckets.Bucket(64, None, None)
    G = c.train.global_batch
    short, long = prices._compute(under_home, rows_of([9] * G, G)), prices._compute(under_home, rows_of([65] * G, G))
    assert short < long  # the same rows, shorter documents: less attention
    expected = worth.pipe_seconds(prices.bucket_score(home, False, 64, G, round(64 * 64)))
    assert long == pytest.approx(expected)
    # twice the global batch's rows: home's pipelines on twice the rows per microbatch, priced as such
    twice = prices._compute(under_home, rows_of([65] * (2 * G), 2 * G))
    assert twice == pytest.approx(worth.pipe_seconds(prices.bucket_score(home, False, 64, 2 * G, 64 * 64)))
    assert twice > long
    row_prices = worth._Pricer(whole_rows, home, Planner(whole_rows).evaluate(home))
    assert row_prices._compute(under_home, rows_of([9] * G, G)) == row_prices._compute(under_home, rows_of([65] * G, G))


@pytest.mark.parametrize("case", ["7b-8-32k-lognormal", "13b-32-64k-github-like", "7b-16-16k-lognormal"])
def test_hotspa_regime_bench_writes_the_cases_cluster(tmp_path, case):
    """bench/planner/plan_buckets_hotspa.py: each case's cluster file loads with its model, GPUs, rows, tokens a step
    and length mixture (both as the runtime's documents and as [plan.documents]); --whole-rows drops the latter."""
    from bench.planner import plan_buckets_hotspa as bench

    model, gpus, length, mixture = case.split("-", 3)
    seq_len = int(length[:-1]) * 1024
    path = tmp_path / "c.toml"
    path.write_text(bench.cluster_text(model, int(gpus), seq_len, mixture))
    c = load_cluster(path)
    assert sum(len(n.devices) for n in c.spec.nodes) == int(gpus) and c.model.seq_len == seq_len
    assert c.model.layers == bench.MODELS[model]["layers"] and c.model.hidden == bench.MODELS[model]["hidden"]
    assert c.train.global_batch * seq_len == bench.TOKENS and c.limits.max_cp == 8
    median, sigma = bench.MIXTURES[mixture]
    assert (c.documents.median, c.documents.sigma) == (median, sigma)
    assert (c.data.doc_len_median, c.data.doc_len_sigma) == (median, sigma)
    path.write_text(bench.cluster_text(model, int(gpus), seq_len, mixture, whole_rows=True))
    assert load_cluster(path).documents.per_row


def test_a_bucket_is_priced_on_the_rows_the_runtime_splits_not_a_multiple_of_the_global_batch(tmp_path):
    """``worth.rows_plan`` splits a bucket's rows as ``bucketing.bucket_split`` does at run time: a fixed bucket of
    home's batch 32 in 4 microbatches has a unit of 4 rows (one per microbatch), so 16 rows are 4 microbatches of 4
    (they raised "not a multiple of the pipelines' batch shares (32)" when the pricing padded to the batch); an
    elastic one keeps its rows per microbatch and takes more microbatches."""
    from hetero_llm.planner.candidates import PipelineChoice
    from hetero_llm.switching import bucketing

    home = plan_cluster(load_cluster(cluster(tmp_path, memory_gb=0.009)), top=1).best
    one = attrs.evolve(home, pipelines=(PipelineChoice(32, 4, home.pipelines[0].stages),))
    fixed = worth.rows_plan(one, 16, False)
    assert [(p.batch, p.microbatches) for p in fixed.pipelines] == [(16, 4)]
    assert bucketing.bucket_split(one.pipelines, 16, False)[1] == [(0, 16, 4)]
    elastic = worth.rows_plan(attrs.evolve(one, pipelines=(PipelineChoice(8, 8, one.pipelines[0].stages),)), 16, True)
    assert [(p.batch, p.microbatches) for p in elastic.pipelines] == [(16, 16)]  # one row per microbatch
    assert worth.rows_plan(one, 32, False) is one
    with pytest.raises(ValueError, match="not a multiple"):
        worth.rows_plan(one, 6, False)
