"""The tests of tests/unit/test_plan.py that start a Python subprocess (the integration tier).

Plan arithmetic against hand-computed expectations: rank numbering, layer ranges, batch shares,
stage-boundary routes and gradient-sync buckets (the common refinement of differently sharded
parameters). Pure and single-process: layouts are written inline and compiled without torch.
"""

from __future__ import annotations

import os
import subprocess
import sys

from helpers_plan import TP_MIX, make

from hetero_llm.plan import compile_plan


def test_groups_do_not_depend_on_the_hash_seed():
    """Another process with another string-hash seed creates the same groups, sync block groups and routes."""
    code = (
        "from helpers_plan import make, TP_MIX; "
        "from hetero_llm.plan import compile_plan; p = compile_plan(make(TP_MIX)); "
        "print(repr((p.groups, p.sync_blocks, p.routes_f, p.routes_b)))"
    )
    here = compile_plan(make(TP_MIX))
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where helpers_plan is
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)  # helpers_plan; the root is cwd
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.dirname(tests),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": path},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr((here.groups, here.sync_blocks, here.routes_f, here.routes_b))
