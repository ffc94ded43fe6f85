"""The tests of tests/unit/test_api.py that start a Python subprocess (the integration tier).

The public API (hetero_llm.__all__, docs/api.md): its examples run, its answers equal the command lines' and the
library's own, it raises the CLI's one-line errors, ``import hetero_llm`` stays light, and a run that fails or
outlives its timeout is returned as such."""

from __future__ import annotations

import subprocess
import sys

from harness import ROOT


def test_import_is_light():
    """``import hetero_llm`` loads neither torch nor the layout code; the API, once used, still no torch."""
    code = (
        "import sys, hetero_llm; assert 'hetero_llm.layout' not in sys.modules and 'torch' not in sys.modules; "
        "hetero_llm.evaluate(hetero_llm.load('layouts/quickstart.toml')); assert 'torch' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
