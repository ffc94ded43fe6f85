"""Helpers shared by tests/unit/test_elastic.py and tests/integration/test_elastic_processes.py; not a test module."""

from __future__ import annotations

from pathlib import Path

from bench.elastic import elastic_agents as agents_mod
from harness import LAYOUTS, common_sections

COMMON = common_sections(LAYOUTS / "reference" / "reference.toml")

NODES = {"n0": 2, "n1": 1, "n2": 1}  # devices per node (torchrun --nproc-per-node differs per agent)


def cluster_file(path: Path, steps: int, port: int = 29500, kinds: str = "") -> Path:
    """Three CPU nodes (2, 1 and 1 devices), the reference model; a small planner budget; ``kinds``: more TOML."""
    path.write_text(agents_mod.cluster_text(COMMON, NODES, steps, port) + kinds)
    return path
