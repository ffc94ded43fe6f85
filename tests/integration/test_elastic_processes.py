"""The tests of tests/unit/test_elastic.py that start processes or train for real (the integration tier).

Elastic runs (hetero_llm/launch/elastic.py): ``hetero-launch CLUSTER.toml --elastic`` under torchrun's agents.

In process: the planning of a round (deterministic, for the nodes present), the mapping of devices to layout
ranks, and every bad input as one line. In real processes: three emulated nodes on this machine, one torchrun
agent each; a node is killed mid-run (its agent's whole process group), the survivors re-plan and continue,
the node comes back and the plan grows back; the per-step losses equal the one-process run's.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import helpers_elastic
import pytest
from helpers_elastic import across_nodes, cluster_file, wait

from bench.elastic import elastic_agents as agents_mod
from harness import free_port, sigint_as_in_a_terminal
from hetero_llm.launch import elastic
from hetero_llm.planner import load_cluster

NODES = {"n0": 2, "n1": 1, "n2": 1}  # devices per node (torchrun --nproc-per-node differs per agent)


def _kill_node(agent: subprocess.Popen) -> None:
    agents_mod.signal_node(agent, signal.SIGKILL)


def _rounds(workdir: Path) -> list[str]:
    return agents_mod.rounds(workdir)


@pytest.mark.multiprocess
@pytest.mark.timeout(1500)  # over the suite's 300 s per test: more than 300 s at load 6 on one core, nothing hung
def test_a_node_lost_and_back_trains_the_one_process_model(tmp_path):
    """``python -m bench.elastic.elastic --quick`` (also the bench's smoke run): 3 emulated nodes, n2 killed (its agent and
    worker, SIGKILL) after step 3, started again after step 6, 20 steps (14 left when it starts: its agent may take 10 s on a loaded host); checked here from its results file."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "bench.elastic.elastic", "--quick", "--out-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        preexec_fn=sigint_as_in_a_terminal,
    )
    try:
        out, _ = bench.communicate(timeout=1200)  # a hang's bound (the bench's own waits give up sooner)
    finally:  # stopped early (by this bound or the suite's): Ctrl-C runs its clean-up, which stops its nodes
        if bench.poll() is None:
            bench.send_signal(signal.SIGINT)
            try:
                bench.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                bench.kill()
                bench.communicate()
        for left in Path("/dev/shm").glob(f"bench_elastic_{bench.pid}_*"):
            shutil.rmtree(left, ignore_errors=True)
    assert bench.returncode == 0, out
    got = json.loads((tmp_path / "elastic.json").read_text())
    members = [agents_mod.members(r) for r in got["rounds"]]
    lost = members.index("n0, n1")  # re-planned without n2 ...
    assert members[0] == members[-1] == "n0, n1, n2" and 0 < lost < len(members) - 1, got["rounds"]
    starts = [agents_mod.start_step(r) for r in got["rounds"]]
    assert starts[lost + 1] > starts[lost], got["rounds"]  # ... trained steps without it, then took it back in
    # disk saves every 5 steps, snapshots every step: the kill after step 3 resumes from a snapshot in memory
    assert got["rounds"][lost].endswith(")") and "from a snapshot in memory" in got["rounds"][lost], got["rounds"]
    assert got["snapshots_left_behind"] is False  # the finished run removed its snapshots from /dev/shm
    assert [c["where"] for c in got["save_cost"]] == ["disk", "memory"]  # a save per step, measured (not judged)
    assert got["steps"] == list(range(1, 21))  # no step twice or skipped, the metrics file continuous
    for step, (a, b) in enumerate(zip(got["losses"], got["reference_losses"]), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a!r} vs the one-process run's {b!r}"
    assert [r["members"] for r in got["results"]] == ["n0, n1", "n0, n1, n2"]
    # each round's tokens/s beside the planner's prediction for the plan it ran (the bench checks the fingerprints)
    assert [r["members"] for r in got["rates"]] == members, got["rates"]
    assert all(r["plan"] in line and r["predicted_tokens_s"] > 0 for r, line in zip(got["rates"], got["rounds"]))
    assert all(r["recovery_s"] > 0 and r["steps_redone"] >= 0 for r in got["results"])
    assert (tmp_path / "elastic.png").stat().st_size > 0 and "## Recoveries" in (tmp_path / "elastic.md").read_text()


@pytest.mark.multiprocess
def test_a_job_that_fails_for_good_leaves_no_snapshot_in_memory(tmp_path):
    """Agents without a restart left (--max-restarts 0) and snapshots every step in a private HETERO_SHM_DIR: n0,
    whose worker is torchrun's rank 0 and serves the round's store, is killed after step 3, so n1 cannot recover in
    place (it says why), its worker fails, the job ends; it removed its snapshot folder on the way out. (torchrun's
    rendezvous is served by this test, so that the lost node is not its host.)"""
    from datetime import timedelta

    import torch.distributed as dist

    work = tmp_path / "run"
    work.mkdir()
    shm = {node: tmp_path / f"shm-{node}" for node in NODES}  # each node's memory
    cluster, rdzv = cluster_file(work / "c.toml", 40, free_port()), free_port()
    store = dist.TCPStore("127.0.0.1", rdzv, 3, True, timeout=timedelta(seconds=300), wait_for_workers=False)
    metrics = work / "m.jsonl"
    client = agents_mod.Where(is_host=",is_host=0")

    def agent(node: str) -> subprocess.Popen:
        return agents_mod.start_agent(
            cluster, node, NODES[node], rdzv, work, 12.0, (100, 1), 0, shm[node], where=client
        )

    agents = [agent("n0")]
    try:
        agents.append(agent("n1"))  # after n0's: on one host torchrun numbers the agents by pid, n0's workers first
        wait(
            "3 steps and a snapshot",
            lambda: len(helpers_elastic.steps(metrics)) >= 3 and any(shm["n1"].glob("*/*/step-*/rank*.json")),
            agents,
            work,
        )
        _kill_node(agents[0])
        shutil.rmtree(shm["n0"])  # its memory gone with it
        assert agents[1].wait(600) != 0  # out of restarts: the job failed for good
    finally:
        for a in agents:
            _kill_node(a)
        del store
    logs = "".join(p.read_text() for p in work.glob("*.log"))
    assert "not recovered in place (this round's store (torchrun's rank 0, node n0) is gone" in logs, logs[-3000:]
    assert list(shm["n1"].iterdir()) == [], logs[-3000:]


@pytest.mark.multiprocess
def test_the_node_that_alone_held_a_stage_is_lost_and_its_replicas_resume_it(tmp_path):
    """n0 runs stage 0 of both pipelines (n0:0 -> n1:0, n0:1 -> n2:0) and is killed after step 3 with its memory:
    no survivor ran stage 0, and there is no disk save. Each rank's snapshot has a replica on the next node
    (checkpoint/replicas.py): the survivors resume from a snapshot step, not from step 0. (torchrun's rendezvous
    is served by this test, so that the lost node is not its host.)"""
    from datetime import timedelta

    import torch.distributed as dist

    steps = 8
    ref, work, cluster, rdzv = across_nodes(tmp_path, steps)
    plan = elastic.plan_for(load_cluster(cluster), ["n0", "n1", "n2"])
    assert [["+".join(s.devices) for s in p.stages] for p in plan.pipelines] == [["n0:0", "n1:0"], ["n0:1", "n2:0"]]
    store = dist.TCPStore("127.0.0.1", rdzv, 3, True, timeout=timedelta(seconds=300), wait_for_workers=False)
    metrics = work / "m.jsonl"
    shm = {node: tmp_path / f"shm-{node}" for node in NODES}
    client = agents_mod.Where(is_host=",is_host=0")

    def agent(node: str) -> subprocess.Popen:
        return agents_mod.start_agent(cluster, node, NODES[node], rdzv, work, 4.0, (100, 1), 6, shm[node], where=client)

    agents = [agent(n) for n in NODES]
    try:
        wait(
            "3 steps on all nodes and a replica of n0's ranks on n1",
            lambda: (
                "n0, n1, n2" in "".join(_rounds(work))
                and len(helpers_elastic.steps(metrics)) >= 3
                and any(shm["n1"].glob("*/*/step-*/rank0.json"))
            ),
            agents,
            work,
        )
        _kill_node(agents[0])
        shutil.rmtree(shm["n0"])  # its memory gone with it
        wait("the survivors' round", lambda: _rounds(work)[-1].startswith("elastic: nodes n1, n2 ("), agents[1:], work)
        for a in agents[1:]:
            assert a.wait(600) == 0, "\n".join(p.read_text()[-3000:] for p in work.glob("*.log"))
    finally:
        for a in agents:
            _kill_node(a)
        del store
    survivors = _rounds(work)[-1]
    # n1 holds rank 0's replica (stage 0 of n0:0) beside its own stage 1: without replicas, step 0 (no disk save)
    assert " from a snapshot in memory held on n1" in survivors and agents_mod.start_step(survivors) >= 2, survivors
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for step, (a, b) in enumerate(zip([r["loss"] for r in rows], ref.losses), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a!r} vs the one-process run's {b!r}"
