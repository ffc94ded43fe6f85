"""Helpers shared by tests/unit/test_torch_free.py and tests/integration/test_torch_free_processes.py; not a test module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent  # tests/

BLOCK_TORCH = "import sys; sys.modules['torch'] = None; "


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + code], capture_output=True, text=True, cwd=TESTS.parent, timeout=240
    )
