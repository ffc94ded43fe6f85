"""Helpers shared by tests/unit/test_input_safety.py and tests/integration/test_input_safety_saved.py; not a test module."""

from __future__ import annotations

import os
from pathlib import Path

NO_LINKS = "(writes never follow one: remove the link, or give another folder)"


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder``: a file's bytes, a link's target, a folder as 'dir'."""
    out: dict[str, bytes | str] = {}
    for p in sorted(folder.rglob("*")):
        key = str(p.relative_to(folder))
        out[key] = f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


def _elsewhere(tmp_path: Path) -> Path:
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    target.write_text("not yours")
    return target
