"""The traps of an elastic run under real torchrun agents (hetero_llm/launch/guards.py; in process:
tests/unit/test_elastic_traps.py): a configuration error ends the job once, not at every restart."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from helpers_elastic import cluster_file

from bench.elastic import elastic_agents as agents_mod
from harness import free_port

REFUSAL = (
    "two torchrun agents say they are node n1 (local rank 0 arrived twice): give each agent its own HETERO_NODE=NAME"
)


@pytest.mark.multiprocess
def test_the_same_node_twice_ends_the_job_once(tmp_path):
    """Three agents, two of them HETERO_NODE=n1, each with restarts left (--max-restarts 6): every worker of the
    round refuses in one line and stops its own agent; no agent starts the round again."""
    work = tmp_path / "run"
    work.mkdir()
    cluster, rdzv = cluster_file(work / "c.toml", 4, free_port()), free_port()

    def agent(node: str) -> subprocess.Popen:
        return agents_mod.start_agent(cluster, node, 1 if node == "n1" else 2, rdzv, work, 4.0, (1, 0), 6)

    agents = [agent("n0")]
    try:
        agents_mod.wait_serving(agents[0], rdzv)
        agents += [agent("n1"), agent("n1")]
        t0 = time.monotonic()
        codes = [a.wait(600) for a in agents]
        took = time.monotonic() - t0
    finally:
        for a in agents:
            if a.poll() is None:
                agents_mod.signal_node(a, signal.SIGKILL)
    logs = {p.name: p.read_text() for p in sorted(work.glob("*.log"))}
    text = "\n".join(f"--- {name}\n{log[-4000:]}" for name, log in logs.items())
    assert all(code != 0 for code in codes), (codes, text)
    refusals = sum(log.count(REFUSAL) for log in logs.values())
    # one round's workers refuse (4: n0's two, one per n1 agent), or fewer when a stopped agent stopped its worker
    # first; never a refusal per restart (6 restarts left: up to 28 lines before)
    assert 1 <= refusals <= 4, (refusals, text)
    assert all("attempts left" not in log or "will restart worker group" not in log for log in logs.values()), text
    assert not list((work / "ckpt").glob(".hetero-shared.*"))
    print(f"the job ended {took:.1f} s after the agents started")
