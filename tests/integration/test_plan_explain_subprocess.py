"""The tests of tests/unit/test_plan_explain.py that start a Python subprocess (the integration tier).

hetero-plan explains itself and gives the same plan on any machine: a budget counted in work (the wall-clock
cap a safety net the output names), idle devices and why, --explain/--json without -o, input errors before
the search, a bounded global batch, allowed schedules only, a --profile that refuses noisy numbers.
Torch-free (the CLI in this process; the determinism test runs it in subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers_plan_explain import edited

from harness import LAYOUTS

SMALL = LAYOUTS / "clusters" / "small_cpu.toml"

HOLMES = LAYOUTS / "clusters" / "holmes_64gpu.toml"


def plan_in_a_process(cluster: Path, out: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "hetero_llm.cli.plan", str(cluster), "-o", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_plan_is_the_same_file_on_a_busy_and_an_idle_machine(tmp_path):
    """The search's budget is work (plans simulated), not time: planned while another process keeps a core
    busy, and on the idle machine, the written layouts are the same bytes."""
    cluster = edited(tmp_path, lambda t: t.replace("[plan]\n", "[plan]\nmax_evals = 200\n", 1), HOLMES)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = plan_in_a_process(cluster, tmp_path / "busy.toml")
    finally:
        spinner.kill()
        spinner.wait()
    idle = plan_in_a_process(cluster, tmp_path / "idle.toml")
    assert (tmp_path / "busy.toml").read_bytes() == (tmp_path / "idle.toml").read_bytes()
    assert busy["cut_by_time"] is False and idle["cut_by_time"] is False
    assert busy["evaluated"] == idle["evaluated"] >= 200  # the work budget ended both searches
    assert busy["plans"] == idle["plans"]
