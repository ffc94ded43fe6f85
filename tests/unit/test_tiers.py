"""The test tiers are folders (tests/conftest.py): every test module lives in tests/unit/ or tests/integration/, and
no unit test is marked as starting processes (multiprocess, netns, gpu). Torch-free."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PROCESS_MARKS = ("multiprocess", "netns", "gpu")


def test_every_test_module_is_in_a_tier_folder():
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == []
    assert {p.parent.name for p in TESTS.rglob("test_*.py")} == {"unit", "integration"}


def test_no_unit_test_is_marked_as_starting_processes():
    marked = sorted(
        f"{p.name}:{n.lineno}: pytest.mark.{n.attr}"
        for p in (TESTS / "unit").glob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.Attribute) and n.attr in PROCESS_MARKS and getattr(n.value, "attr", "") == "mark"
    )
    assert marked == []
