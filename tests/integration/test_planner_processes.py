"""The tests of tests/unit/test_planner.py that start processes or train for real (the integration tier).

hetero-plan: cost arithmetic, the search's rules on small cases, bad cluster files, and planned layouts
training the reference model. Single process and torch-free except the one multi-process test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import LAYOUTS, assert_same_model, launch
from hetero_llm.planner import plan_cluster
from hetero_llm.planner.cluster import load_cluster
from hetero_llm.planner.output import layout_text

SMALL = LAYOUTS / "clusters" / "small_cpu.toml"


@pytest.mark.multiprocess
def test_a_lower_ranked_plan_trains_the_reference_model_too(tmp_path, shared_launch):
    """The best plan with two pipelines (and another schedule than the pick) trains what one process does."""
    c = load_cluster(SMALL)
    result = plan_cluster(c, top=10)
    cand, score = next(
        cs for cs in result.ranked if len(cs[0].pipelines) > 1 and cs[0].schedule != result.best.schedule
    )
    path = tmp_path / "planned.toml"
    path.write_text(layout_text(c, cand, score, None))
    assert_same_model(
        launch(path, tmp_path / "run"),
        shared_launch(LAYOUTS / "reference" / "hexiscale.toml"),  # as test_invariance's
    )


def test_plan_bench_quick(tmp_path):
    """bench/planner/plan_bench.py --quick runs end to end; its plans keep the planner's guarantees."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.planner.plan_bench", "--quick", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "plan_bench.json").read_text())
    assert len(data["small"]) == 2 and len(data["large"]) == 1
    for row in data["small"]:  # the search against the optimum of plans that use every device
        assert row["ratio"] <= 1.03
    for row in data["large"]:
        assert row["ours"] <= row["place"] and row["memory_ok"]
    md = (tmp_path / "plan_bench.md").read_text()  # the report header (title, command, machine, load), then the tables
    assert md.startswith("# plan_bench\n\n`python -m bench.planner.plan_bench --quick") and "\n## vs exhaustive\n" in md


@pytest.mark.multiprocess
def test_plan_vs_measured_quick(tmp_path):
    """bench/planner/plan_vs_measured.py --quick: two planned layouts run with emulated device speeds."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.planner.plan_vs_measured", "--quick", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "plan_vs_measured.json").read_text())
    assert len(data["rows"]) == 2
    for row in data["rows"]:  # the emulated durations are a floor: a step cannot beat the model's compute
        assert row["measured_s"] >= 0.8 * row["predicted_s"]
