"""Retention in real runs (``--keep-last N``; the folder logic itself: tests/unit/test_keep_last.py): a run saving
every step keeps the newest 3 by default, and a resumed run keeps the save it resumed from."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import LAYOUTS, common_sections, launch, write_layout
from hetero_llm.checkpoint import folders

COMMON = common_sections(LAYOUTS / "reference" / "reference.toml")


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*"))


@pytest.mark.multiprocess
def test_a_run_saving_every_step_keeps_3_by_default_and_a_resumed_run_keeps_its_save(tmp_path):
    path = write_layout(tmp_path / "l.toml", COMMON, [(12, 3, [(6, 1)])])
    first = tmp_path / "a"
    first.mkdir()
    launch(path, first, "--checkpoint-every", "1", "--set", "train.steps=5")
    root = first / "ckpt"
    assert _steps(root) == [3, 4, 5]  # the default with --checkpoint-every: the newest 3
    resumed = folders.step_folder(root, 3)  # resumed in the same folder, saving every step, keeping 1
    args = ("--checkpoint-every", "1", "--keep-last", "1", "--resume", str(resumed), "--set", "train.steps=7")
    launch(path, first, *args)
    assert _steps(root) == [3, 7]  # the newest, and the save it resumed from
    assert folders.find(root).step == 7
