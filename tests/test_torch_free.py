"""The torch-free core (layout, plan, schedules, simulator, placement, dry runs) works without torch.

Python is started with ``sys.modules["torch"] = None``, which makes every ``import torch`` fail as
if torch were not installed; it then imports the torch-free modules and runs their test files.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

TORCH_FREE_MODULES = [
    "errors",
    "_fs",
    "layout",
    "layout.fields",
    "layout.schema",
    "layout.cluster_schema",
    "layout.reader",
    "layout.rules",
    "layout.data_rules",
    "layout.cluster_rules",
    "layout.cluster_file",
    "model.params",
    "model.cp_chunks",
    "plan",
    "plan.rank",
    "plan.describe",
    "plan.zero1_slices",
    "plan.blocks",
    "plan.schedules",
    "schedule",
    "schedule.ir",
    "schedule.generators",
    "schedule.lowering",
    "schedule.dependencies",
    "schedule.validator",
    "schedule.files",
    "data.batches",
    "data.documents",
    "data.held_out",
    "data.text_cache",
    "data.token_files",
    "data.tokenizers",
    "predict.simulate",
    "predict.trace",
    "predict.timeline",
    "predict.device",
    "switching.transfers",
    "switching.bucketing",
    "switching.predict",
    "switching.worth",
    "runtime.emulation",
    "checkpoint.folders",
    "checkpoint.holders",
    "checkpoint.trust",
    "interop.hf_names",
    "interop.hf_config",
    "launch.node",
    "launch.hosts",
    "launch.external",
    "launch.restart",
    "launch.preflight",
    "launch.outputs",
    "launch.memory",
    "planner",
    "planner.cluster",
    "planner.candidates",
    "planner.cost",
    "planner.memory",
    "planner.pipesim",
    "planner.search",
    "planner.shares",
    "planner.layers",
    "planner.moves",
    "planner.move_parts",
    "planner.exact",
    "planner.output",
    "planner.place",
    "planner.structure",
    "planner.evaluate",
    "api",
    "sweep",
    "sweep.spec",
    "sweep.points",
    "sweep.results",
    "sweep.report",
    "planner.documents",
    "planner.context",
    "cli.common",
    "cli.launch",
    "cli.plan",
    "cli.sweep",
    "cli.place",
    "cli.timeline",
    "cli.tokenize",
]
TORCH_FREE_TESTS = [
    "test_layout_errors.py",
    "test_schedule.py",
    "test_simulate.py",
    "test_plan.py",
    "test_schedule_combinations.py",
    "test_place.py",
    "test_docs.py",
    "test_data.py",
    "test_cli_errors.py",
    "test_switch.py",
    "test_rankplan.py",
    "test_cp_chunks.py",
]

BLOCK_TORCH = "import sys; sys.modules['torch'] = None; "


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + code], capture_output=True, text=True, cwd=TESTS.parent, timeout=240
    )


def test_blocking_works():
    """The harness really hides torch (else the other tests here prove nothing)."""
    proc = run_without_torch("import torch")
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


def test_core_modules_import_without_torch():
    imports = "; ".join(f"import hetero_llm.{m}" for m in TORCH_FREE_MODULES)
    proc = run_without_torch(imports)
    assert proc.returncode == 0, proc.stderr


def test_torch_free_tests_pass_without_torch():
    """Their unit-tier tests: multi-process ones train, which needs torch; the one integration test among them,
    the schedule-combination grid (tests/test_schedule_combinations.py, ~8 s), compiles plans through the same
    torch-free code as test_plan.py and test_rankplan.py, which run here."""
    args = ["-q", "-x", "-p", "no:cacheprovider", "-m", "not integration", *(str(TESTS / f) for f in TORCH_FREE_TESTS)]
    proc = run_without_torch(f"import pytest; raise SystemExit(pytest.main({args!r}))")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout.splitlines()[-1]
