"""The tests of tests/integration/test_buckets.py that run in this process (the unit tier).

[[buckets]] layouts: each bucket of document lengths under its own layout (hot switching).

Bad input is in tests/bad_layouts/bucket*.toml. Here: what each bucket compiles to, what --dry-run
shows (on CPU and on CUDA devices), and layout invariance: a switching run trains the same model as one process on the same
documents (float32, 1e-5 per step), for 3 buckets over DP 4 / TP 2 x DP 2 / PP 2 x TP 2 (1f1b, gpipe),
for 3 buckets over TP 3 (home) / asymmetric zbh1 / PP 2 with TP 2 then 1, dynamic / interleaved with an
idle device (TP 2 <-> TP 3), with empty buckets skipped, and across a resume in the middle of a run; held-out
loss under the home layout equals one process's.
"""

from __future__ import annotations

from pathlib import Path

from harness import invoke_cli
from hetero_llm import layout as layout_mod
from hetero_llm.layout import Schedule, bucket_layout
from hetero_llm.plan import compile_plan

THREE = (
    Path(__file__).resolve().parents[2] / "layouts" / "examples" / "hot_switch.toml"
)  # DP 4 | TP 2 x DP 2 | PP 2 x TP 2
DATA = Path(__file__).resolve().parents[1] / "data"
TWO = DATA / "buckets_two.toml"  # DP 2 | home TP 2
CP = DATA / "buckets_cp.toml"  # DP 2 | cp 2 | home TP 2
CP_HOME = DATA / "buckets_cp_home.toml"  # DP 2 | home cp 2 | TP 2, home cp 2


def test_each_bucket_compiles_to_its_own_layout():
    lay = layout_mod.load(THREE)
    assert [b.max_len for b in lay.buckets] == [16, 32, 64]
    plans = compile_plan(lay).buckets
    assert [len(p.layout.pipelines) for p in plans] == [4, 2, 1]
    assert [p.world_size for p in plans] == [4, 4, 4]
    # bucket 1 has its own schedule; bucket 2 has no pipelines: the home layout, whose global batch it keeps
    assert [p.layout.train.schedule for p in plans] == [Schedule.ONE_F_ONE_B, Schedule.GPIPE, Schedule.ONE_F_ONE_B]
    assert bucket_layout(lay, 2).pipelines == lay.pipelines and bucket_layout(lay, 2).train.global_batch == 8
    assert bucket_layout(lay, 0).train.global_batch == 4  # the sum of its pipelines' row shares
    # the same model in every bucket: parameters keep their shapes, so switches can move them
    assert {p.layout.model for p in plans} == {lay.model}
    assert {d for p in plans for d in (r.device_id for r in p.ranks)} == {r.device_id for r in compile_plan(lay).ranks}


def test_dry_run_shows_the_buckets_and_the_switches_of_a_step():
    result = invoke_cli(THREE, "--dry-run")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "bucket 0: documents of 1-16 positions, rows of 16, 4 ranks, schedule 1f1b" in out
    assert "bucket 2: documents of 33-64 positions, rows of 64, home layout" in out
    # home -> 0 -> 1 -> 2 (the home layout): no switch out of bucket 2, no gradients into bucket 0
    assert "switch home -> bucket 0: 276 parameter and 0 gradient transfers" in out
    assert "switch bucket 0 -> bucket 1: 180 parameter and 360 gradient transfers" in out
    assert "switch bucket 1 -> bucket 2: 0 parameter and 180 gradient transfers" in out  # home's parameters stayed
    switches = out.split("simulated step")[0]  # then the simulator's step (tests/unit/test_switching_predict.py)
    assert "-> home" not in switches and "bucket 2 ->" not in switches


def test_dry_run_of_buckets_on_cuda_devices_over_nccl_describes_the_switch():
    """[[buckets]] on GPUs is a layout like any other (the switch exchange is NCCL's batched point-to-point)."""
    gpus = (
        "--set",
        'cluster.nodes[0].devices=["cuda:0", "cuda:1", "cuda:2", "cuda:3"]',
        "--set",
        "cluster.backend=nccl",
    )
    result = invoke_cli(THREE, "--dry-run", *gpus)
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "switch home -> bucket 0: 276 parameter and 0 gradient transfers" in out  # as on CPU devices
    assert (
        "before the first step): bucket 0's 1 group, bucket 1's 5 groups, then the switch group of all 4 ranks; "
        "each switch is one batched point-to-point (batch_isend_irecv, nccl) in it"
    ) in out


def test_buckets_can_be_overridden_from_the_command_line():
    lay = layout_mod.load(THREE, ["buckets.1.max_len=40"])
    assert [b.max_len for b in lay.buckets] == [16, 40, 64]


def test_ranks_agree_on_a_bucket_layout_whatever_the_schedule_files_path(tmp_path):
    """The plan fingerprint every rank checks at rendezvous covers the buckets, schedule files by name."""
    # bucket 0's first pipeline (one stage, one microbatch) runs a hand-written order
    plain = "[[buckets.pipelines]]\nbatch = 1\nmicrobatches = 1\n"
    text = THREE.read_text().replace(plain, plain + 'schedule_file = "order.txt"\n', 1)
    prints = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "order.txt").write_text("F0 B0\n")
        (tmp_path / name / "layout.toml").write_text(text)
        lay = layout_mod.load(tmp_path / name / "layout.toml")
        assert lay.buckets[0].pipelines[0].schedule_file == str(tmp_path / name / "order.txt")
        prints.append(compile_plan(lay).fingerprint())
    other = layout_mod.load(tmp_path / "a" / "layout.toml", ["buckets.1.max_len=40"])
    assert prints[0] == prints[1] != compile_plan(other).fingerprint()


def test_every_bucket_is_sized_by_its_documents_not_padded_to_the_global_batch():
    """buckets_two.toml: bucket 1 runs under the home layout (batch 4 in 2 microbatches). Two long documents
    fill 2 rows: it runs those 2 (one per microbatch, the smallest unit in home's proportions), not 4."""
    import numpy as np

    from hetero_llm.switching.bucketing import bucket_rows, bucket_shares, bucket_split

    lay = layout_mod.load(TWO)
    assert lay.train.global_batch == 4 and not lay.buckets[1].pipelines
    docs = [np.arange(n + 1) % 7 for n in (30, 3, 25)]  # positions
    short, long = bucket_rows(lay, docs)
    assert long.num_rows == 2 and short.num_rows == 2  # DP 2's unit is its shares, 1 + 1
    assert bucket_shares(lay.pipelines, elastic=False) == [2] and bucket_shares(lay.pipelines, elastic=True) == [2]
    assert bucket_split(lay.pipelines, long.num_rows, elastic=False) == (1, [(0, 2, 2)])
    assert bucket_rows(lay, docs * 3)[1].num_rows == 6  # 6 long documents: 6 rows, 2 microbatches of 3
    # elastic: home's microbatches of 2 rows, as many as the rows need (its 4 in 2 divide by 2: a unit of 2 rows)
    elastic = layout_mod.load(TWO, ["buckets.1.elastic=true"])
    three = bucket_rows(elastic, docs * 3 + docs[:1])[1]
    assert three.num_rows == 8 and bucket_split(elastic.pipelines, 8, elastic=True) == (4, [(0, 8, 4)])
    plan = compile_plan(elastic).buckets[1].for_rounds(3)
    assert [(p.batch, p.microbatches) for p in plan.layout.pipelines] == [(6, 3)]


def test_a_context_parallel_bucket_is_compiled_for_rows_of_its_max_len():
    result = invoke_cli(CP, "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert "TP per stage (x share): [1 cp 2] x2" in result.stdout
    assert "p0.s0: cp 2 over rows of 16, positions held: node0:0 0-3 + 12-15, node0:1 4-7 + 8-11" in result.stdout
    plans = compile_plan(layout_mod.load(CP)).buckets
    assert [p.row_width for p in plans] == [8, 16, 32]
    ctx = plans[1].rank_plan(1).context
    assert ctx is not None and ctx.chunks == ((4, 8), (8, 12)) and ctx.ranks == (0, 1)
    home_cp = compile_plan(layout_mod.load(CP_HOME))  # home cp 2: its bucket of 16 gets chunks of 4, home's of 8
    assert home_cp.rank_plan(0).context.chunks == ((0, 8), (24, 32))
    assert home_cp.buckets[1].rank_plan(0).context.chunks == ((0, 4), (12, 16))
