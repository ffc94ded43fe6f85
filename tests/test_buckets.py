"""[[buckets]] layouts: each bucket of document lengths under its own layout (hot switching).

Bad input is in tests/bad_layouts/bucket*.toml; here the good layout: what each bucket compiles to,
what --dry-run shows, and that a run is refused (the switching step is not built yet) with one line.
"""

from __future__ import annotations

from pathlib import Path

from harness import assert_one_error_line, invoke_cli
from hetero_llm import layout as layout_mod
from hetero_llm.layout import Schedule, bucket_layout
from hetero_llm.plan import compile_plan
from hetero_llm.switch import bucket_plans

THREE = Path(__file__).resolve().parent / "data" / "buckets_three.toml"


def test_each_bucket_compiles_to_its_own_layout():
    lay = layout_mod.load(THREE)
    assert [b.max_len for b in lay.buckets] == [16, 32, 64]
    plans = bucket_plans(lay)
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
    # home -> 0 -> 1 -> 2 (the home layout): no switch into or out of bucket 2, parameters only into bucket 0
    assert "switch home -> bucket 0: 276 parameter and 0 gradient transfers" in out
    assert "switch bucket 0 -> bucket 1:" in out and "switch bucket 1 -> bucket 2:" in out
    assert "-> home" not in out and "bucket 2 ->" not in out


def test_a_switching_run_is_refused_with_one_line():
    assert_one_error_line(invoke_cli(THREE, "--quiet"), f"{THREE}: buckets: hot-switching runs are not implemented yet "
                          "(--dry-run shows the bucket layouts and their switches; remove [[buckets]] to train under "
                          "[[pipelines]])")


def test_buckets_can_be_overridden_from_the_command_line():
    lay = layout_mod.load(THREE, ["buckets.1.max_len=40"])
    assert [b.max_len for b in lay.buckets] == [16, 40, 64]
