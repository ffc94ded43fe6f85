"""The tests of tests/unit/test_cli_args.py that start processes or train for real (the integration tier).

Every command-line argument and environment variable is checked: one line, exit code 2, never a traceback.

Each command has ``--version`` and help text for every option; hetero-generate's flags are checked before
anything loads; every environment variable ``hetero-launch`` reads is refused in one line naming it, its
value and what it expects; absurd sizes (steps, memory) are refused before any rank starts.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys


def test_version_in_a_real_process():
    proc = subprocess.run(
        [sys.executable, "-m", "hetero_llm.cli.generate", "--version"], capture_output=True, text=True, timeout=120
    )
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout == f"hetero-generate {importlib.metadata.version('hetero_llm')}\n"
