"""The torch-free core (layout, plan, schedules, simulator, placement, dry runs) works without torch.

Python is started with ``sys.modules["torch"] = None``, which makes every ``import torch`` fail as
if torch were not installed; it then imports the torch-free modules and runs their test files.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hetero_llm import _properties

TESTS = Path(__file__).resolve().parent

TORCH_FREE_MODULES = sorted(_properties.torch_free())  # declared once, in hetero_llm/_properties.py
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


def test_the_declared_modules_exist():
    """Every package and module hetero_llm/_properties.py names is in the tree (a misspelt one would promise
    nothing)."""
    packages = _properties.TORCH_FREE_PACKAGES + _properties.RUNTIME_SIDE_PACKAGES
    assert [p for p in packages if not (_properties.PACKAGE / p / "__init__.py").is_file()] == []
    declared = _properties.torch_free() | _properties.runtime_side()
    assert [name for name, path in declared.items() if not path.is_file()] == []
    assert {"hetero_llm.planner.moves", "hetero_llm.layout.writer", "hetero_llm.cli.plan"} <= set(TORCH_FREE_MODULES)


def test_core_modules_import_without_torch():
    """Every module of a torch-free package (the tree's, new ones included) and every torch-free module named."""
    imports = "; ".join(f"import {m}" for m in TORCH_FREE_MODULES)
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
