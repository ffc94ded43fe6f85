"""The tests of tests/unit/test_layout_errors.py that start a Python subprocess (the integration tier).

Every bad layout gets one located line on stderr and exit code 2; every good layout dry-runs.

The bad inputs are files in ``tests/bad_layouts/``, one case each, whose first line is
``# expect: <the line after 'error: '>`` with the layout's path written ``{file}`` (and its folder
``{dir}``). Messages are compared exactly: they are the interface a user reads.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers_layout_errors import expected_line

TESTS = Path(__file__).resolve().parents[1]  # tests/: the shared data and bad layouts

REPO = TESTS.parent


def test_real_subprocess():
    """Once for real: the installed entry module, its exit code and its stderr, outside CliRunner."""
    path = Path("tests") / "bad_layouts" / "unknown_key_typo.toml"
    proc = subprocess.run(
        [sys.executable, "-m", "hetero_llm.cli", str(path), "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == f"error: {expected_line(REPO / path).replace(str(REPO / path), str(path))}\n"
    assert proc.stderr.count("\n") == 1
