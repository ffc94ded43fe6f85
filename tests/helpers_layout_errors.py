"""Helpers shared by tests/unit/test_layout_errors.py and tests/integration/test_layout_errors_subprocess.py; not a test module."""

from __future__ import annotations

from pathlib import Path


def expected_line(path: Path) -> str:
    first = path.read_bytes().split(b"\n", 1)[0].decode("ascii")
    prefix = "# expect: "
    assert first.startswith(prefix), f"{path.name}: first line must be '{prefix}<message>'"
    return first[len(prefix) :].replace("{file}", str(path)).replace("{dir}", str(path.parent))
