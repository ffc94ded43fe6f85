"""``hetero-plan --buckets``: a layout per document-length bucket (hetero_llm/planner/buckets.py). Torch-free."""

from __future__ import annotations

import pytest
from helpers_plan import cluster, run_plan

from hetero_llm import layout as layout_mod
from hetero_llm.planner import buckets, load_cluster
from hetero_llm.planner.search import Planner


def test_short_documents_get_their_own_layout_when_memory_binds_the_long_ones(tmp_path):
    """Rows of 1024 must be spread over devices to fit 5 MB; rows of 128 need not: their bucket gets its own
    plan, predicted faster on its rows than the home layout, and the layout runs (loads) with the buckets."""
    path = cluster(tmp_path, memory_gb=0.005)
    out = tmp_path / "out.toml"
    res = run_plan(path, "-o", out, "--buckets", "128")
    assert res.exit_code == 0, res.stderr
    lay = layout_mod.load(out)
    assert [b.max_len for b in lay.buckets] == [128, 1024]
    assert lay.buckets[0].pipelines and not lay.buckets[1].pipelines  # the longest: the home layout
    home_devices = {d for p in lay.pipelines for s in p.stages for d in s.devices}
    assert {d for p in lay.buckets[0].pipelines for s in p.stages for d in s.devices} <= home_devices
    # the bucket's plan beats the home layout on its rows by the margin that pays for switching
    c = load_cluster(path)
    proposed = buckets.propose(c, (128, 1024), _home(c))
    shorter = Planner(_at(c, 128)).evaluate(_home(c))
    assert proposed[0].plan is not None
    assert proposed[0].score.step_time * buckets.MIN_GAIN <= shorter.step_time
    # written elastic (1F1B, every pipeline with at least as many microbatches as stages), its shares cut by
    # their microbatches' common divisor: same rows per microbatch and proportions; the home bucket tops up
    plan, unit = proposed[0].plan, buckets.elastic_unit(proposed[0].plan)
    assert lay.buckets[0].elastic and not lay.buckets[0].top_up and lay.buckets[1].top_up and unit > 1
    assert [(p.batch, p.microbatches) for p in lay.buckets[0].pipelines] == [
        (p.batch // unit, p.microbatches // unit) for p in plan.pipelines
    ]


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
    assert [b.max_len for b in lay.buckets] == [16, 64] and not any(b.pipelines for b in lay.buckets)
    assert "is not 1.05x faster than home's on its rows" in out.read_text()


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
