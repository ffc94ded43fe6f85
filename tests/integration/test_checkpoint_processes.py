"""The tests of tests/unit/test_checkpoint.py that start processes or train for real (the integration tier).

Checkpoints without processes: which save ``--resume`` picks, slicing saved shards for another layout,
restoring either AdamW, and every bad ``--resume`` as one exact line (exit code 2, before any rank starts)."""

from __future__ import annotations

import subprocess
import sys

from harness import LAYOUTS, ROOT

REFERENCE = LAYOUTS / "reference" / "reference.toml"  # 6 layers, hidden 32; train.steps = 3

FIX = "pass the --checkpoint DIR of an earlier run or one of its step-NNNNNN folders, or start without --resume"


def test_bad_resume_in_a_real_process(tmp_path):
    """Once outside CliRunner: one line on stderr, exit code 2, no traceback, no rank started."""
    proc = subprocess.run(
        [sys.executable, "-m", "hetero_llm.cli", str(REFERENCE), "--resume", str(tmp_path / "nope")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"error: {tmp_path / 'nope'}: --resume: no such folder ({FIX})\n"
