"""bench/gpu/gpu_bench.py runs end to end in its CPU smoke mode (``--tiny --device cpu``).

The real numbers come from a GPU machine; this keeps the script runnable there: both sides of the
single-stage comparison train, and the 2-stage and TP-2 layouts run through hetero-launch with a
step-time breakdown read back from their traces, and hot switching's switch layout, its switches' time read
back from its trace.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.multiprocess


def test_tiny_cpu_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.gpu_bench", "--tiny", "--device", "cpu", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "gpu_bench_tiny.json").read_text())
    single = result["single_stage"]
    assert {(r["impl"], r["seq"], r["mode"]) for r in single} == {
        (i, s, "eager") for i in ("ours", "plain") for s in (32, 64)
    }
    for r in single:
        assert r["tokens_per_s"] > 0 and math.isfinite(r["final_loss"]), r
        assert len(r["step_seconds"]) == result["config"]["steps"]
    assert [m["layout"] for m in result["multi_rank"]] == ["2 stages, 1f1b, 4 microbatches", "1 stage, TP 2"]
    pipeline = [b for b in result["breakdown"] if b["layout"].startswith("2 stages")]
    assert len(pipeline) == 2 and all(b["F"] > 0 and b["B"] > 0 and b["SEND"] > 0 for b in pipeline)
    tp = [b for b in result["breakdown"] if b["layout"] == "1 stage, TP 2"]
    assert len(tp) == 2 and all(b["SEND"] == 0 and b["RECV"] == 0 for b in tp)
    table = (tmp_path / "gpu_bench_tiny.md").read_text()
    assert "| model | seq | batch | mode  | impl  | step ms | tokens/s | MFU | peak GiB | ours/plain |" in table
    assert "Step-time breakdown" in table
    switch = result["switch"]  # two ranks on the one device over gloo, switching every step with short documents
    assert switch["backend"] == "gloo" and switch["steps_with_switches"] > 0, switch
    assert 0 < switch["switch_s"] <= switch["step_s"] and switch["network_mib"] > 0, switch
    assert "## Hot switching: a step's switches (traced)" in table
