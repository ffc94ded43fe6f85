"""Helpers shared by tests/unit/test_zero_bubble.py and tests/integration/test_zero_bubble_processes.py; not a test module."""

from __future__ import annotations

import pytest

from harness import LAYOUTS, common_sections

REFERENCE = LAYOUTS / "reference" / "reference.toml"

COMMON = common_sections(REFERENCE)  # 6 layers, hidden 32, 4 heads, rmsnorm, rope, swiglu


@pytest.fixture(scope="module")
def reference(shared_launch):
    return shared_launch(REFERENCE)  # one run for the modules that compare with it (conftest.py)
