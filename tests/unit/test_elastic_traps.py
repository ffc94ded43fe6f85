"""The traps an elastic run guards against (hetero_llm/launch/guards.py; issue 38, criterion 6; a race of issue 33):
a round started on a save with every step trained ends as done; a --checkpoint DIR the nodes do not share is one
line before training; a refusal stops the worker's own torchrun agent (not retried); an orphaned worker exits;
every snapshot a restart passes over says why. The torchrun agents: tests/integration/test_elastic_traps_processes.py.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from helpers_elastic import cluster_file

from bench.elastic import elastic_agents as agents_mod
from bench.elastic import snapshot_restart
from harness import free_port, invoke_cli
from hetero_llm.checkpoint import folders, holders, trust
from hetero_llm.errors import LayoutError
from hetero_llm.launch import elastic, elastic_worker, guards
from hetero_llm.planner import load_cluster

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_VARS = [v for v in os.environ if v.startswith(("TORCHELASTIC_", "SLURM_"))] + list(agents_mod.DROP)


def _store(world: int, master: bool, port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world, master, timeout=timedelta(seconds=30), wait_for_workers=False)


def _threads(world: int, work) -> dict[int, object]:
    """``work(store, rank)`` in one thread per rank over a real TCPStore (rank 0's serves it): each rank's result or
    the exception it raised."""
    server = _store(world, True, 0)
    results: dict[int, object] = {}

    def run(rank: int) -> None:
        try:
            results[rank] = work(server if rank == 0 else _store(world, False, server.port), rank)
        except Exception as e:  # reported, not lost in the thread
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


# --------------------------------------------------------------------------- a round on a complete save (issue 33)


@pytest.mark.parametrize("start, steps, resume, done", [(0, 4, None, False), (3, 4, "s", False), (4, 4, "s", True)])
def test_a_round_whose_save_has_every_step_is_done(start, steps, resume, done):
    line = guards.finished_line(start, steps, resume)
    assert (line is not None) is done
    if done:
        assert line == (
            "elastic: the run was already complete (s is at step 4 of train.steps 4): nothing left to train, this "
            "round ends as done"
        )


def test_rank_0_keeps_the_store_up_until_every_worker_of_a_done_round_read_it():
    zero_done = threading.Event()

    def work(store, rank: int):
        if rank == 0:
            guards.end_finished_round(store, 0, 3, 30.0)
            zero_done.set()
            return "returned"
        time.sleep(0.5 * rank)  # the others come late: rank 0 must still be there (it waits on their count)
        early = zero_done.is_set()
        guards.end_finished_round(store, rank, 3, 30.0)
        return "rank 0 gone first" if early else "read it"

    assert _threads(3, work) == {0: "returned", 1: "read it", 2: "read it"}


@pytest.fixture
def clean_env(monkeypatch):
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_a_round_started_on_a_complete_save_ends_as_done(tmp_path, clean_env):
    """A rejoining node's round after the others trained every step: exit 0 and one line, not 'nothing left to
    train' (exit 2). One worker, torchrun's environment set by hand (its rank 0 serves the round's store)."""
    path = cluster_file(tmp_path / "c.toml", 4)
    lay = elastic.plan_for(load_cluster(str(path)), ["n1"])
    folder = folders.step_folder(tmp_path / "ck", 4)
    folder.mkdir(parents=True)
    folders.rank_file(folder, 0).write_bytes(b"")
    folders.finish_save(folder, 4, 1, lay)  # a save at step 4 of train.steps 4
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(free_port()), TORCHELASTIC_RUN_ID="job", TORCHELASTIC_USE_AGENT_STORE="False")
    for k, v in {**env, "TORCHELASTIC_RESTART_COUNT": "0", "HETERO_NODE": "n1"}.items():
        clean_env.setenv(k, v)
    result = invoke_cli(str(path), "--elastic", "--checkpoint", str(tmp_path / "ck"))
    assert (result.exit_code, result.stderr) == (0, ""), result.stderr
    assert result.stdout == (
        f"elastic: the run was already complete ({folder} is at step 4 of train.steps 4): nothing left to train, "
        "this round ends as done\n"
    )
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step-000004"]  # no token file left


# --------------------------------------------------------------------------- an unshared checkpoint folder


def test_a_checkpoint_folder_the_nodes_share_passes_and_leaves_nothing(tmp_path):
    members = [("n0", 0), ("n0", 1), ("n1", 0), ("n2", 0)]
    results = _threads(4, lambda store, r: guards.check_shared(store, r, members, str(tmp_path / "ck")))
    assert results == {r: None for r in range(4)}
    assert list((tmp_path / "ck").iterdir()) == []


def test_a_checkpoint_folder_one_node_does_not_share_is_one_line_on_every_worker(tmp_path):
    members = [("n0", 0), ("n1", 0), ("n2", 0)]
    own = {0: tmp_path / "ck", 1: tmp_path / "ck", 2: tmp_path / "n2-local" / "ck"}  # n2 mounts another folder
    results = _threads(3, lambda store, r: guards.check_shared(store, r, members, str(own[r])))
    for rank, e in results.items():
        assert isinstance(e, LayoutError), e
        assert str(e) == (
            f"{own[rank]}: --checkpoint: is not one folder shared by every node: node n0 does not see what n2 wrote "
            "there; node n1 does not see what n2 wrote there; node n2 does not see what n0, n1 wrote there (every "
            "round resumes from it: give every node's agent the same --checkpoint DIR, on storage all nodes mount "
            "at that path)"
        )
    assert list(own[0].iterdir()) == list(own[2].iterdir()) == []


def test_a_checkpoint_folder_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    target = tmp_path / "file" / "ck"
    results = _threads(1, lambda store, r: guards.check_shared(store, r, [("n0", 0)], str(target)))
    assert isinstance(results[0], LayoutError)
    assert str(results[0]) == (
        f"{target}: --checkpoint: cannot be written on node n0 (Not a directory): give a writable folder, shared by "
        "every node"
    )


# --------------------------------------------------------------------------- a refusal ends the job once


def test_two_agents_claiming_one_node_name_the_variable(tmp_path):
    cluster = load_cluster(cluster_file(tmp_path / "c.toml", 4))
    with pytest.raises(LayoutError) as e:
        elastic_worker.present_nodes(cluster, [("n1", 0), ("n0", 0), ("n0", 1), ("n1", 0)])
    assert str(e.value) == (
        f"{cluster.file}: environment HETERO_NODE: two torchrun agents say they are node n1 (local rank 0 arrived "
        "twice): give each agent its own HETERO_NODE=NAME in its environment"
    )


def _fake_agent(child: str, *, stdout=subprocess.PIPE) -> subprocess.Popen:
    """A process whose command line is a torchrun agent's (``torch.distributed.run`` among its words) that starts
    ``child`` (Python) and prints whether a SIGTERM stopped it (it waits for one up to 60 s after the child)."""
    parent = textwrap.dedent(
        f"""
        import signal, subprocess, sys, threading
        stopped = threading.Event()
        signal.signal(signal.SIGTERM, lambda *a: stopped.set())
        child = subprocess.Popen([sys.executable, "-c", {child!r}])
        print(child.pid, flush=True)
        child.wait()
        print("stopped" if stopped.wait(60) else "not stopped", child.returncode, flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", parent, "torch.distributed.run"],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_a_refusal_stops_the_workers_own_agent_once_its_line_is_out():
    child = (
        "import sys\nfrom hetero_llm.launch import guards\nassert guards.end_job_on_refusal()\n"
        "sys.stderr.write('error: the refusal\\n')\nsys.exit(2)\n"
    )
    agent = _fake_agent(child)
    out, err = agent.communicate(timeout=120)
    assert out.splitlines()[1] == "stopped 2", (out, err)
    assert err == "error: the refusal\n"
    assert guards.end_job_on_refusal() is False  # this test's parent is no torchrun agent: nothing is signalled


# --------------------------------------------------------------------------- an orphaned worker


def test_an_orphaned_worker_exits_naming_its_agent(tmp_path):
    child = (
        "import sys, threading\nfrom hetero_llm.launch import guards\nassert guards.watch_my_agent(0.05)\n"
        "print('watching', flush=True)\nthreading.Event().wait(120)\nprint('trained on alone', flush=True)\n"
    )
    agent = _fake_agent(child)
    assert agent.stdout is not None and agent.stderr is not None
    pid = int(agent.stdout.readline())
    assert agent.stdout.readline() == "watching\n"
    agent.kill()  # kill -9 of the agent: the worker is re-parented
    agent.wait()
    t0 = time.monotonic()
    err = ""
    while select.select([agent.stderr], [], [], 60)[0]:  # until the worker, the last writer, closes the pipe
        chunk = agent.stderr.readline()
        if not chunk:
            break
        err += chunk
    assert time.monotonic() - t0 < 30
    assert err == (
        f"error: elastic: this worker's torchrun agent (pid {agent.pid}) is gone (killed?): ending this worker, "
        "which would otherwise train on alone\n"
    ), err
    assert agent.stdout.read() == ""  # it never trained on
    deadline = time.monotonic() + 30  # its pipe closes as it ends: the process itself may take a moment more
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid)
    assert guards.watch_my_agent() is False  # this test's parent is no torchrun agent


def _gone(pid: int) -> bool:
    """Whether process ``pid`` ended (gone, or a zombie its new parent has not reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except OSError:
        return True


# --------------------------------------------------------------------------- every snapshot passed over says why

PLACED = {"n0": [0, 2], "n1": [1], "n2": [3]}  # the ranks of snapshot_restart's plan per node


def _held(plan, tmp_path: Path, step: int, nodes) -> dict[str, list]:
    key = trust.run_key(tmp_path / "ckpt")
    shm = tmp_path / "shm"
    for node, ranks in PLACED.items():
        snapshot_restart.snapshot_ranks(plan, shm / node / "a-000000", step, ranks, key)
    return {n: holders.held(shm / n, key) for n in nodes}


def test_a_snapshot_older_than_the_disk_save_says_so(tmp_path):
    plan = snapshot_restart.dp_pp_plan(tmp_path)
    held = _held(plan, tmp_path, 3, ["n0", "n1", "n2"])
    assert holders.choose(held, plan.layout, 5) is None
    assert holders.skipped(held, plan.layout, 5, None) == [
        "elastic: the snapshot of step 3 (round a-000000) held on n0, n1, n2 is skipped: older: not newer than the "
        "disk's save of step 5"
    ]


def test_a_snapshot_whose_holders_were_lost_says_which_ranks_and_falls_back_to_the_disk(tmp_path, capsys):
    plan = snapshot_restart.dp_pp_plan(tmp_path)
    disk = snapshot_restart.disk_save(plan, tmp_path, 3)
    _held(plan, tmp_path, 5, ["n0"])
    for lost in ("n1", "n2"):  # stage 1's holders
        shutil.rmtree(tmp_path / "shm" / lost)
    results = snapshot_restart.agree_round(plan, tmp_path / "ckpt", tmp_path / "shm", ["n0"])
    assert results["n0"][0] == (str(disk), "")
    err = capsys.readouterr().err
    assert err.startswith(
        "elastic: the snapshot of step 5 (round a-000000) held on n0 is skipped: incomplete: rank(s) 1, 3 of its 4 "
        "held by no node present (holder lost); "
    ), err
    assert err.endswith(f" is in no file held; resuming from {disk} instead\n") and err.count("\n") == 1, err


def test_a_snapshot_file_shorter_than_its_record_says_so(tmp_path, capsys):
    plan = snapshot_restart.dp_pp_plan(tmp_path)
    _held(plan, tmp_path, 5, [])
    pt = folders.rank_file(folders.step_folder(tmp_path / "shm" / "n1" / "a-000000", 5), 1)
    size = pt.stat().st_size
    pt.write_bytes(pt.read_bytes()[:-10])
    assert holders.held(tmp_path / "shm" / "n1", trust.run_key(tmp_path / "ckpt")) == []
    assert capsys.readouterr().err == (
        f"elastic: {pt}: skipped, incomplete: {size - 10} bytes, its record says {size}\n"
    )
