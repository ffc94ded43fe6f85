"""The traps of an elastic run under real torchrun agents (hetero_llm/launch/guards.py; in process:
tests/unit/test_elastic_traps.py): a configuration error ends the job once, not at every restart; a worker whose
agent is killed exits."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers_elastic import cluster_file

from bench.elastic import elastic_agents as agents_mod
from harness import free_port

CASES = {  # the agents started (node, its cluster file's train.steps) and the line every worker of the round gives
    "the same node twice": (
        [("n0", 4), ("n1", 4), ("n1", 4)],
        "environment HETERO_NODE: two torchrun agents say they are node n1 (local rank 0 arrived twice): give each "
        "agent its own HETERO_NODE=NAME in its environment",
    ),
    "another cluster file on one node": (
        [("n0", 4), ("n1", 5)],
        "every agent must run the same hetero_llm and cluster file",
    ),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_a_configuration_error_ends_the_job_once(tmp_path, case):
    """Agents with restarts left (--max-restarts 6) whose round is refused: every worker of it refuses in one line
    and stops its own agent (or its agent fails with the rendezvous host's); no agent starts the round again."""
    started, refusal = CASES[case]
    work = tmp_path / "run"
    work.mkdir()
    port, rdzv = free_port(), free_port()
    files = {steps: cluster_file(work / f"c{steps}.toml", steps, port) for steps in {s for _, s in started}}

    def agent(node: str, steps: int) -> subprocess.Popen:
        return agents_mod.start_agent(files[steps], node, 1 if node == "n1" else 2, rdzv, work, 4.0, (1, 0), 6)

    agents = [agent(*started[0])]
    try:
        agents_mod.wait_serving(agents[0], rdzv)
        agents += [agent(*a) for a in started[1:]]
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
    refusals = sum(log.count(refusal) for log in logs.values())
    # one round's workers refuse (at most one line per worker: 4 or 3 here), or fewer when a stopped agent stopped
    # its workers first; never a round per restart (6 restarts left: up to 7 rounds' lines before)
    workers = sum(1 if node == "n1" else 2 for node, _ in started)
    assert 1 <= refusals <= workers, (refusals, text)
    assert not list((work / "ckpt").glob(".hetero-shared.*"))
    print(f"{case}: the job ended {took:.1f} s after the agents started")


@pytest.mark.multiprocess
def test_a_worker_whose_agent_is_killed_exits_naming_it(tmp_path):
    """``kill -9`` of n1's agent alone (torch starts its worker in a session of its own, so the worker outlives
    it): the worker notices within a second or so and exits with one line, instead of training on as an orphan."""
    work = tmp_path / "run"
    work.mkdir()
    cluster, rdzv = cluster_file(work / "c.toml", 40, free_port()), free_port()
    metrics = work / "m.jsonl"

    def agent(node: str) -> subprocess.Popen:
        return agents_mod.start_agent(cluster, node, 2 if node == "n0" else 1, rdzv, work, 12.0, (100, 0), 0)

    agents = [agent("n0")]
    workers: list[int] = []
    try:
        agents_mod.wait_serving(agents[0], rdzv)
        agents.append(agent("n1"))
        deadline = time.monotonic() + 600
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # training on both nodes
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), _logs(work)
            time.sleep(0.1)
        workers = agents_mod.children(agents[1].pid)
        assert len(workers) == 1, workers
        agents[1].kill()  # the agent alone, not its worker
        agents[1].wait()
        t0 = time.monotonic()
        while Path(f"/proc/{workers[0]}").exists() and not _zombie(workers[0]):
            assert time.monotonic() < t0 + 60, _logs(work)
            time.sleep(0.05)
        print(f"the orphaned worker ended {time.monotonic() - t0:.2f} s after its agent was killed")
    finally:
        for a in agents:
            if a.poll() is None:
                agents_mod.signal_node(a, signal.SIGKILL)
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    line = f"error: elastic: this worker's torchrun agent (pid {agents[1].pid}) is gone (killed?): ending this worker"
    assert line in _logs(work)


def _logs(work: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(work.glob("*.log")))


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
