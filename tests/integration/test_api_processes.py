"""The tests of tests/unit/test_api.py that start processes or train for real (the integration tier).

The public API (hetero_llm.__all__, docs/api.md): its examples run, its answers equal the command lines' and the
library's own, it raises the CLI's one-line errors, ``import hetero_llm`` stays light, and a run that fails or
outlives its timeout is returned as such."""

from __future__ import annotations

import os
import re

import pytest

import hetero_llm as hl
from harness import LAYOUTS, ROOT
from hetero_llm.errors import RankFailure

QUICKSTART = LAYOUTS / "quickstart.toml"


@pytest.mark.integration
@pytest.mark.multiprocess
def test_the_documented_examples_run(tmp_path):
    """Every ```python block of docs/api.md, in order, from the repository root (one of them trains 3 steps)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)
    assert len(blocks) >= 5
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for block in blocks:
            exec(compile(block, "docs/api.md", "exec"), {})
    finally:
        os.chdir(cwd)
    assert not (ROOT / "unused-out").exists()


@pytest.mark.integration
@pytest.mark.multiprocess
def test_failures_and_timeouts_are_returned(tmp_path):
    """A --set that validates but diverges in the ranks: status failed, its error line and exit code 3; a run past
    its timeout: stopped with every process of its group."""
    diverged = hl.run(QUICKSTART, tmp_path / "div", ["train.steps=3", "train.lr=1e30", "train.min_lr=1e29"])
    assert (diverged.status, diverged.exit_code) == ("failed", 3)
    assert diverged.error.startswith("error: training diverged at step ")
    with pytest.raises(RankFailure, match="training diverged") as e:
        diverged.check()
    assert e.value.exit_code == 3
    env = {"HETERO_EMULATE_ACTION_S": "*:F=0.5;B=0.5"}  # 50 steps of 8 such actions: minutes
    slow = hl.run(QUICKSTART, tmp_path / "slow", ["train.steps=50"], timeout_s=8, env=env)
    assert (slow.status, slow.exit_code, slow.error) == ("timeout", None, "error: stopped after the timeout of 8 s")
    # stopped at the timeout, not at the end: the uninterrupted run's emulated actions alone last 200 s (half of
    # that leaves a loaded machine its slack; 8-9 s on an idle one)
    assert slow.wall_s < 200 / 2 and len(slow.steps) < 50
