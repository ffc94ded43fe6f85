"""Helpers shared by tests/unit/test_rendezvous.py and tests/integration/test_rendezvous_processes.py; not a test module."""

from __future__ import annotations

import torch.distributed  # noqa: F401  (imported here, so the timed rendezvous below does not include it)

from harness import LAYOUTS, common_sections, write_layout
from hetero_llm import layout as layout_mod
from hetero_llm.plan import compile_plan

COMMON = common_sections(LAYOUTS / "reference" / "reference.toml")

TWO_PIPELINES = [(6, 2, [(3, 1), (3, 1)]), (6, 2, [(6, 1)])]  # n0: ranks 0, 1; n1: rank 2


def _plan(tmp_path, *overrides, pipelines=TWO_PIPELINES):
    path = write_layout(tmp_path / "l.toml", COMMON, pipelines)
    return compile_plan(layout_mod.load(path, list(overrides))), path
