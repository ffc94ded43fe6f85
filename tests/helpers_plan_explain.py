"""Helpers shared by tests/unit/test_plan_explain.py and tests/integration/test_plan_explain_subprocess.py; not a test module."""

from __future__ import annotations

from pathlib import Path

from harness import LAYOUTS

SMALL = LAYOUTS / "clusters" / "small_cpu.toml"


def edited(tmp_path: Path, edit, source: Path = SMALL, name: str = "cluster.toml") -> Path:
    text = source.read_text()
    new = edit(text)
    assert new != text  # the edit applies
    path = tmp_path / name
    path.write_text(new)
    return path
