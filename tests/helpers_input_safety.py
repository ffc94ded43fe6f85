"""Helpers shared by tests/unit/test_input_safety.py and tests/integration/test_input_safety_processes.py; not a test module."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness import LAYOUTS

REFERENCE = LAYOUTS / "reference" / "reference.toml"


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A real save of layouts/reference/reference.toml after 2 of its 3 steps (hetero-launch --checkpoint)."""
    from harness import launch

    workdir = tmp_path_factory.mktemp("saved")
    launch(REFERENCE, workdir, "--set", "train.steps=2")
    return workdir / "ckpt"


@pytest.fixture
def ckpt(saved_run, tmp_path) -> Path:
    """A copy of the save to damage."""
    return Path(shutil.copytree(saved_run, tmp_path / "ckpt", symlinks=True))


def _export(*args):
    from hetero_llm.cli import export

    return CliRunner().invoke(export.main, [str(a) for a in args])


def _generate(*args):
    from hetero_llm.cli import generate

    return CliRunner().invoke(generate.main, [str(a) for a in args])
