"""Helpers of the benchmark tests (tests/integration/test_bench_*.py): a bench script run as a user starts it, and
its results files checked; not a test module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.common import benchlib

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, out: Path) -> subprocess.CompletedProcess:
    """``python -m bench.AREA.SCRIPT --quick --out-dir OUT`` from the repository root, as a user starts it."""
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{script}", "--quick", "--out-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=benchlib.clean_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"{script} --quick failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def _headers(markdown: str) -> list[list[str]]:
    """Column names of every markdown table in ``markdown``, in order."""
    lines = markdown.splitlines()
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for prev, line in zip([""] + lines, lines)
        if line.startswith("| ") and not prev.startswith("|")
    ]


def _check_files(
    out: Path, name: str, columns: list[str], fields: list[str], more_tables: tuple[list[str], ...] = ()
) -> dict:
    md = (out / f"{name}.md").read_text()
    headers = _headers(md)
    for table in (columns, *more_tables):
        assert table in headers, f"no table with columns {table} in {name}.md (tables: {headers})"
    assert "load average" in md and "torch" in md  # the machine and the load are published with the table
    payload = json.loads((out / f"{name}.json").read_text())
    assert payload["results"], "no result rows"
    for row in payload["results"]:
        assert set(fields) <= set(row), f"missing {sorted(set(fields) - set(row))}"
    assert (out / f"{name}.png").stat().st_size > 0
    return payload
