"""Helpers shared by tests/unit/test_sweep.py and tests/integration/test_sweep_processes.py; not a test module."""

from __future__ import annotations

from pathlib import Path

from harness import LAYOUTS

QUICKSTART = LAYOUTS / "quickstart.toml"


def spec(tmp_path: Path, body: str, sweep_table: str = "") -> Path:
    """A sweep file over the quickstart layout (predict mode unless ``sweep_table`` says otherwise)."""
    path = tmp_path / "s.toml"
    head = sweep_table or 'mode = "predict"'
    path.write_text(f'[sweep]\nlayout = "{QUICKSTART}"\n{head}\n\n{body}')
    return path
