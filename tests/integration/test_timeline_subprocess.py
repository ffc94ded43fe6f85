"""The tests of tests/unit/test_timeline.py that start a Python subprocess (the integration tier).

Timelines: rank trace files -> Chrome/Perfetto JSON and PNG; simulated timelines; the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers_timeline import assert_png

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_cli_as_a_subprocess(tmp_path: Path) -> None:
    out = tmp_path / "sim.png"
    args = ["--simulate", "--stages", "2", "--microbatches", "4", "--schedule", "interleaved", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "hetero_llm.timeline", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "mean bubble" in done.stdout
    assert_png(out)
