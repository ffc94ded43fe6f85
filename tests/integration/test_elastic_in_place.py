"""In-place recovery of an elastic round (hetero_llm/launch/in_place.py): a node killed, the survivors keep their
worker processes, agree on the membership, re-plan and resume from the snapshot step their nodes hold in memory,
and train the one-process model.

Three emulated nodes on this machine, one torchrun agent each (tests/integration/test_elastic_processes.py has the
restarting cases). torchrun's rendezvous is served by n0's agent and torchrun's rank 0 (which serves the round's
store) runs on n0: the node killed is n2.
"""

from __future__ import annotations

import json
import signal
import subprocess

import helpers_elastic
import pytest
from helpers_elastic import NODES, across_nodes, wait

from bench.elastic import elastic_agents as agents_mod
from hetero_llm.launch import elastic
from hetero_llm.planner import load_cluster


@pytest.mark.multiprocess
@pytest.mark.parametrize("event", ["killed", "hung"])
def test_a_lost_node_is_recovered_in_place_by_the_survivors_processes(tmp_path, event):
    """n2 (which runs stage 1 of the second pipeline) is lost after step 3 with its memory: killed (its connections
    close) or hung (SIGSTOP of its agent and worker: its sockets stay open, and the survivors' heartbeats name it
    after cluster.timeout_s); snapshots every step, no disk save. The survivors' workers are the same processes
    before and after; they resume from a snapshot step (n2's blocks from their replica on n0), every step once,
    per-step losses within 1e-5 of the one-process run."""
    steps = 8
    ref, work, cluster, rdzv = across_nodes(tmp_path, steps)
    plan = elastic.plan_for(load_cluster(cluster), ["n0", "n1", "n2"])
    assert [["+".join(s.devices) for s in p.stages] for p in plan.pipelines] == [["n0:0", "n1:0"], ["n0:1", "n2:0"]]
    metrics = work / "m.jsonl"
    shm = {node: tmp_path / f"shm-{node}" for node in NODES}

    def agent(node: str) -> subprocess.Popen:
        return agents_mod.start_agent(cluster, node, NODES[node], rdzv, work, 4.0, (100, 1), 6, shm[node])

    agents = [agent("n0")]
    try:
        agents_mod.wait_serving(agents[0], rdzv)  # n0 serves torchrun's rendezvous (and runs its rank 0)
        agents += [agent("n1"), agent("n2")]
        wait(
            "3 steps on all nodes and a replica of n2's rank on n0",
            lambda: (
                "n0, n1, n2" in "".join(agents_mod.rounds(work))
                and len(helpers_elastic.steps(metrics)) >= 3
                and any(shm["n0"].glob("*/*/step-*/rank3.json"))
            ),
            agents,
            work,
        )
        workers = {n: sorted(agents_mod.children(a.pid)) for n, a in zip(NODES, agents)}
        agents_mod.signal_node(agents[2], signal.SIGKILL if event == "killed" else signal.SIGSTOP)
        wait("the run's last step", lambda: len(set(helpers_elastic.steps(metrics))) >= steps, agents[:2], work)
        wait(
            "the survivors' workers to end",
            lambda: all(not agents_mod.children(a.pid) for a in agents[:2]),
            agents[:2],
            work,
        )
        kept = {n: workers[n] for n in ("n0", "n1")}
    finally:
        for a in agents:  # the survivors' agents wait in torchrun's exit barrier for the dead one (300 s)
            agents_mod.signal_node(a, signal.SIGKILL)
    logs = helpers_elastic.logs(work)
    rounds = agents_mod.rounds(work)
    assert [agents_mod.members(r) for r in rounds] == ["n0, n1, n2", "n0, n1"], logs
    assert ", in place: n2 lost, survivors agreed in " in rounds[-1], rounds
    assert " from a snapshot in memory held on n0" in rounds[-1] and agents_mod.start_step(rounds[-1]) >= 2, rounds
    assert "elastic: node(s) n2 lost (" in logs and "re-plan in place" in logs, logs
    if event == "hung":  # named by a survivor's heartbeat (nothing else ends its waits: n2's sockets stay open)
        assert "(n2:0) stopped responding: no heartbeat for" in logs and "the survivors recover in place" in logs, logs
    # the survivors' agents never restarted their workers: the only worker processes they ever had were these
    assert all(len(kept[n]) == NODES[n] for n in kept), kept
    assert "Starting worker group" not in "".join(
        p.read_text().split("elastic: node(s) n2 lost", 1)[-1] for p in work.glob("n[01].*.log")
    ), logs
    assert [p for node in ("n0", "n1") for p in shm[node].glob("*")] == []  # each survivor removed its snapshots
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), logs
    for step, (a, b) in enumerate(zip([r["loss"] for r in rows], ref.losses), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a!r} vs the one-process run's {b!r}"
