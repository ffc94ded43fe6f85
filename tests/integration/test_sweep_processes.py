"""The tests of tests/unit/test_sweep.py that start processes or train for real (the integration tier).

hetero-sweep: sweep files read strictly (exact one-line errors), the points of grid, zipped, conditional and drawn
axes, predict-only sweeps (invalid points, resume, shards and their merge, the report), and, with processes, a
sweep killed with SIGKILL mid-run and resumed without redoing a point, a failing point recorded as such."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_sweep import spec

from harness import LAYOUTS, ROOT
from hetero_llm.sweep import results

QUICKSTART = LAYOUTS / "quickstart.toml"


def _launches_of(folder: Path) -> list[int]:
    """The pids of processes whose command line names ``folder`` (a point's hetero-launch and its ranks)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(folder) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.mark.integration
@pytest.mark.multiprocess
def test_a_killed_sweep_resumes_without_redoing_a_point(tmp_path):
    """Three run points (the second diverges: recorded failed, exit code 3, its error line). The sweep is killed
    with SIGKILL once the first point's record is on disk; its running launch dies with it; the same command then
    runs the other two and leaves the first as it was."""
    body = """
[[axes]]
name = "lr"
values = ["0.01", "1e30", "0.02"]
sets = [["train.lr=0.01"], ["train.lr=1e30", "train.min_lr=1e29"], ["train.lr=0.02"]]
"""
    table = 'mode = "both"\nset = ["train.steps=3", "train.log_every=1"]\ntimeout_s = 240'
    path, out = spec(tmp_path, body, table), tmp_path / "out"
    cmd = [sys.executable, "-m", "hetero_llm.cli.sweep", str(path), "-o", str(out)]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 240
    while not ((out / results.RESULTS).exists() and (out / results.RESULTS).read_bytes().count(b"\n") >= 1):
        assert first.poll() is None and time.monotonic() < deadline, "the sweep ended before its first record"
        time.sleep(0.1)
    first.send_signal(signal.SIGKILL)
    first.wait()
    first.stdout.close()
    while _launches_of(out):  # the launch it had started dies with it (PR_SET_PDEATHSIG), its ranks with that
        assert time.monotonic() < deadline, f"left running: {_launches_of(out)}"
        time.sleep(0.1)
    done = results.read(out / results.RESULTS)
    assert [(r["point"], r["status"]) for r in done] == [(0, "ok")]
    # point 1's launch was stopped, not left to finish: it had started moments before, it trained no step
    cut = next((out / "points").glob("0001-*/metrics.jsonl"), None)
    assert cut is None or cut.read_text() == ""
    kept = sorted((out / "points").glob("0000-*/metrics.jsonl"))[0].stat().st_mtime_ns
    second = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming: 1 of 3 points done before, 2 to do" in second.stdout
    records = results.read(out / results.RESULTS)
    assert [(r["point"], r["status"], r["exit_code"]) for r in records] == [
        (0, "ok", 0),
        (1, "failed", 3),
        (2, "ok", 0),
    ]
    assert records[1]["error"].startswith("error: training diverged at step ")
    assert sorted((out / "points").glob("0000-*/metrics.jsonl"))[0].stat().st_mtime_ns == kept  # not redone
    assert records[0] == done[0]
    for r in (records[0], records[2]):
        assert r["measured"]["steps"] == 3 and r["predicted"]["step_time_s"] > 0
    assert records[0]["measured"]["final_loss"] != records[2]["measured"]["final_loss"]
    third = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert "resuming: 3 of 3 points done before, 0 to do" in third.stdout
    assert results.read(out / results.RESULTS) == records
