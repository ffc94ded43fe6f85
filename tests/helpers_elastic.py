"""Helpers shared by tests/unit/test_elastic.py and tests/integration/test_elastic_{processes,in_place}.py; not a
test module."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.elastic import elastic_agents as agents_mod
from harness import LAYOUTS, common_sections, free_port, launch, write_layout

COMMON = common_sections(LAYOUTS / "reference" / "reference.toml")

NODES = {"n0": 2, "n1": 1, "n2": 1}  # devices per node (torchrun --nproc-per-node differs per agent)


def cluster_file(path: Path, steps: int, port: int = 29500, kinds: str = "") -> Path:
    """Three CPU nodes (2, 1 and 1 devices), the reference model; a small planner budget; ``kinds``: more TOML."""
    path.write_text(agents_mod.cluster_text(COMMON, NODES, steps, port) + kinds)
    return path


# The planner told the CPU devices compute 10x faster and links 2.5x faster than the nominal 'cpu' kind: then
# pipelines across nodes pay, and the full membership's plan leaves no node holding every block.
ACROSS_NODES = "[plan.kinds.cpu]\ntflops = 0.05\nmemory_gb = 8\nlink_gbps = 100\nmem_bw_gbs = 10\n"


def steps(metrics: Path) -> list[int]:
    """The steps the run's metrics file records so far."""
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []


def logs(work: Path) -> str:
    """The agents' logs' tails, for a failed assertion."""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(work.glob("*.log")))


def wait(what: str, condition, agents, work: Path, timeout: float = 300) -> None:  # a hang's bound
    """Until ``condition()``; an AssertionError with the logs when an agent failed or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or any(a.poll() not in (None, 0) for a in agents):
            raise AssertionError(f"waiting for {what}:\n{logs(work)}")
        time.sleep(0.1)


def across_nodes(tmp_path: Path, n_steps: int):
    """The one-process run of ``n_steps`` steps (the reference), and the elastic run's folder, cluster file (its
    plan pipelines across nodes: ``ACROSS_NODES``) and rendezvous port."""
    one = tmp_path / "one"
    one.mkdir()
    ref = launch(write_layout(one / "l.toml", COMMON, [(12, 3, [(6, 1)])]), one, "--set", f"train.steps={n_steps}")
    work = tmp_path / "run"
    work.mkdir()
    return ref, work, cluster_file(work / "c.toml", n_steps, free_port(), ACROSS_NODES), free_port()
