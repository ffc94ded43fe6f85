"""The tests of tests/unit/test_rank_plan.py that start a Python subprocess (the integration tier).

Every rank's ``RankPlan``: checked against the whole plan for the shipped layouts, frozen, free of the
layout, and printed exactly by ``hetero-launch L.toml --dry-run --rank R``. Torch-free."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_launch_does_not_import_the_cli():
    """A forked rank runs from the launcher's plan, not through the click command (no import circle)."""
    tree = ast.parse((ROOT / "hetero_llm" / "launch" / "node.py").read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "hetero_llm"
        for alias in node.names
    }
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "cli" not in imported and "hetero_llm.cli" not in imported
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, hetero_llm.launch.node; print('hetero_llm.cli' in sys.modules)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.strip() == "False", proc.stderr
