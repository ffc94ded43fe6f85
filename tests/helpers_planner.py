"""Helpers of the planner tests (tests/unit/test_planner*.py): hetero-plan run in this process, a small cluster
file edited; not a test module."""

from __future__ import annotations

import inspect
from pathlib import Path

from click.testing import CliRunner

from harness import LAYOUTS
from hetero_llm.cli.plan import main as plan_main

SMALL = LAYOUTS / "clusters" / "small_cpu.toml"


def run_plan(*args):
    runner = (
        CliRunner(mix_stderr=False) if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters else CliRunner()
    )
    return runner.invoke(plan_main, [str(a) for a in args])


def small_cluster(tmp_path: Path, plan: str = "", nodes: str = "", edit=None) -> Path:
    text = SMALL.read_text()
    if edit:
        text = edit(text)
    text = text + plan
    if nodes:
        text = text.replace("[plan]\n", nodes + "\n[plan]\n", 1)
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path
