"""Helpers shared by tests/unit/test_timeline.py and tests/integration/test_timeline_subprocess.py; not a test module."""

from __future__ import annotations

from pathlib import Path

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 1000
