"""The tests of tests/unit/test_torch_free.py that start processes or train for real (the integration tier).

The torch-free core (layout, plan, schedules, simulator, placement, dry runs) works without torch.

Python is started with ``sys.modules["torch"] = None``, which makes every ``import torch`` fail as
if torch were not installed; it then imports the torch-free modules and runs their test files.
"""

from __future__ import annotations

from pathlib import Path

from helpers_torch_free import run_without_torch

TESTS = Path(__file__).resolve().parents[1]  # tests/: the shared data and bad layouts

TORCH_FREE_TESTS = [
    "unit/test_layout_errors.py",
    "unit/test_schedule.py",
    "unit/test_simulate.py",
    "unit/test_plan.py",
    "unit/test_schedule_combinations.py",
    "unit/test_place.py",
    "unit/test_docs.py",
    "unit/test_data.py",
    "unit/test_cli_errors.py",
    "unit/test_switch_transfers.py",
    "unit/test_rank_plan.py",
    "unit/test_cp_chunks.py",
]


def test_torch_free_tests_pass_without_torch():
    """Their unit-tier tests: multi-process ones train, which needs torch; the one integration test among them,
    the schedule-combination grid (tests/integration/test_schedule_combinations_grid.py, ~8 s), compiles plans
    through the same torch-free code as test_plan.py and test_rank_plan.py, which run here."""
    args = ["-q", "-x", "-p", "no:cacheprovider", "-m", "not integration", *(str(TESTS / f) for f in TORCH_FREE_TESTS)]
    proc = run_without_torch(f"import pytest; raise SystemExit(pytest.main({args!r}))")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout.splitlines()[-1]
