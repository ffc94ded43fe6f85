"""In-memory snapshots of elastic runs (hetero_llm/checkpoint/snapshots.py, holders.py; launch/restart.py), in one
process: the background write, its failure, what each rank keeps, and the restart's choice by holders over every
node present (a snapshot step copied into --checkpoint DIR, else the disk's save), a holder lost during the copy.
The runs under torchrun: tests/unit/test_elastic.py."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from bench.elastic import snapshot_restart
from harness import LAYOUTS, common_sections, write_layout
from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint import folders, holders, shards, snapshots, trust
from hetero_llm.errors import RankFailure
from hetero_llm.launch import elastic_worker, restart
from hetero_llm.plan import compile_plan

COMMON = common_sections(LAYOUTS / "reference" / "reference.toml").replace("steps = 3", "steps = 20")


def _plan(tmp_path: Path):
    """Two DP pipelines of two stages each: every parameter block has two holders (ranks 0 and 2, 1 and 3)."""
    return snapshot_restart.dp_pp_plan(tmp_path)


_rank = snapshot_restart.rank_state  # a rank's plan, state and optimizer with moments


def _key(tmp_path: Path) -> bytes:
    """The run's snapshot key: the one in its --checkpoint DIR, ``tmp_path/ckpt`` (made by the first call)."""
    return trust.run_key(tmp_path / "ckpt")


def _snapshot(plan, root: Path, step: int, key: bytes, ranks=None) -> dict:
    """Every rank (or ``ranks``) of ``plan`` snapshots at ``step`` into ``root``; their states by rank."""
    return snapshot_restart.snapshot_ranks(plan, root, step, range(plan.world_size) if ranks is None else ranks, key)


def test_a_snapshot_is_written_in_the_background_and_visible_only_when_whole(tmp_path, monkeypatch):
    plan = _plan(tmp_path)
    rp, state, optimizer = _rank(plan, 1)
    release, save = threading.Event(), torch.save
    monkeypatch.setattr(snapshots.torch, "save", lambda obj, f: (release.wait(30), save(obj, f))[1])
    writer = snapshots.SnapshotWriter(rp, tmp_path / "round", _key(tmp_path))
    writer.take(state, optimizer, 4)  # returns with the write in flight
    name, p = next(iter(state.params.items()))
    before = p.detach().clone()
    with torch.no_grad():
        p.add_(1.0)  # the next step changes the parameter: the snapshot holds the copy taken at the boundary
    record = folders.rank_file(folders.step_folder(tmp_path / "round", 4), 1).with_suffix(".json")
    assert writer.thread is not None and writer.thread.is_alive() and not record.exists()
    release.set()
    writer.wait()
    assert json.loads(record.read_text())["step"] == 4
    saved = torch.load(record.with_suffix(".pt"), weights_only=True)
    assert torch.equal(saved["shards"][name]["tensor"], before)


def test_a_failed_write_fails_the_run_naming_the_rank(tmp_path):
    plan = _plan(tmp_path)
    rp, state, optimizer = _rank(plan, 1)
    (tmp_path / "shm").write_text("a file where the snapshot folder should be")
    writer = snapshots.SnapshotWriter(rp, tmp_path / "shm" / "round", _key(tmp_path))
    writer.take(state, optimizer, 2)
    device = plan.ranks[1].device_id
    with pytest.raises(RankFailure, match=rf"^rank 1 \({device}\) could not write its snapshot of step 2 into "):
        writer.wait()


def test_each_rank_keeps_its_two_newest_snapshots(tmp_path):
    plan = _plan(tmp_path)
    rp, state, optimizer = _rank(plan, 0)
    writer = snapshots.SnapshotWriter(rp, tmp_path / "round", _key(tmp_path))
    for step in (1, 2, 3):
        writer.take(state, optimizer, step)
    writer.wait()
    assert sorted(p.name for p in (tmp_path / "round").iterdir()) == ["step-000002", "step-000003"]


# --------------------------------------------------------------------------- the restart's choice over nodes
# Emulated nodes: each has its own snapshot folder (its memory); a lost node's folder is gone with it. The workers
# of a round are threads here, one per node, talking over a real TCPStore as torchrun's workers do.

PLACED = {"n0": [0, 2], "n1": [1], "n2": [3]}  # which ranks of _plan ran on which node: stage 0 both on n0


def _nodes(plan, shm: Path, steps: dict[int, dict[str, list[int]]]) -> dict[int, tuple]:
    """Each node snapshots its ranks' state at each step of ``steps`` (step -> node -> ranks) into ``shm/NODE``
    (the round folder ``a-000000``); the states by rank."""
    states = {}
    for step, placed in steps.items():
        for node, ranks in placed.items():
            states.update(_snapshot(plan, shm / node / "a-000000", step, _key(shm.parent), ranks))
    return states


def _round(plan, tmp_path: Path, nodes: list[str], timeout_s: float = 20.0) -> dict[str, tuple]:
    """One round of the nodes ``nodes`` (one worker each, the first torchrun's rank 0): what each worker's
    ``restart.agree`` returned (or raised)."""
    results = snapshot_restart.agree_round(plan, tmp_path / "ckpt", tmp_path / "shm", nodes, timeout_s)
    return {node: result[:1] if isinstance(result[0], Exception) else result[0] for node, result in results.items()}


def test_a_restart_resumes_the_newest_step_held_across_the_surviving_nodes(tmp_path):
    plan = _plan(tmp_path)
    shm = tmp_path / "shm"
    snapshot_restart.disk_save(plan, tmp_path, 3)
    states = _nodes(plan, shm, {5: PLACED, 6: {"n0": [0, 2], "n2": [3]}})  # n1 lost while step 6 was written
    shutil.rmtree(shm / "n2")  # n2 lost: its memory with it; stage 1 of step 5 is held by n1 (rank 1) only
    # neither node alone holds every block of step 5 (n0: stage 0, n1: stage 1)
    assert holders.choose({"n0": holders.held(shm / "n0", _key(tmp_path))}, plan.layout, 3) is None
    results = _round(plan, tmp_path, ["n0", "n1"])
    folder = folders.step_folder(tmp_path / "ckpt", 5)
    assert results == {n: (str(folder), " from a snapshot in memory held on n0, n1") for n in ("n0", "n1")}
    ckpt = folders.find(tmp_path / "ckpt")  # ``latest`` names it: a complete save, verified like any other
    assert ckpt.path == folder and ckpt.world_size == 2 and folders.verify(ckpt) is None
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "rank0.pt", "rank1.pt"]  # no replica copied
    assert sorted(shm.rglob("*")) == [shm / "n0", shm / "n1"]  # every node emptied its snapshot folder (kept: 0700)
    one = compile_plan(layout_mod.load(str(write_layout(tmp_path / "one.toml", COMMON, [(12, 3, [(6, 1)])]))))
    restored = shards.restore(one.rank_plan(0), str(folder))  # any layout resumes it
    assert restored.step == 5
    held = {name: (s, o) for s, o in (states[0], states[1]) for name in s.params}
    for name, t in restored.shards["tensor"].items():
        state, optimizer = held[name]
        p = state.params[name]
        assert torch.equal(t, p.detach()), name
        assert torch.equal(restored.shards["exp_avg"][name], optimizer.state[p]["exp_avg"]), name


def test_a_folder_several_nodes_share_counts_each_file_once(tmp_path):
    """One machine, or HETERO_SHM_DIR on shared storage: every node lists the same files."""
    plan = _plan(tmp_path)
    _snapshot(plan, tmp_path / "shared" / "a-000000", 5, _key(tmp_path))
    _snapshot(plan, tmp_path / "shared" / "a-000000", 6, _key(tmp_path), ranks=[2, 3])  # pipeline 1 holds every block
    listed = holders.held(tmp_path / "shared", _key(tmp_path))
    choice = holders.choose({"n0": listed, "n1": listed}, plan.layout, 3)
    assert choice is not None and choice.step == 6 and choice.nodes == ["n0"]  # the first node that lists them
    assert [(f.rank, f.new_rank) for f in choice.files] == [(2, 0), (3, 1)]
    assert holders.choose({"n0": listed, "n1": listed}, plan.layout, 6) is None  # the disk's save is as new


def test_a_block_whose_only_holders_were_lost_falls_back_to_the_disk_save(tmp_path):
    plan = _plan(tmp_path)
    shm = tmp_path / "shm"
    disk = snapshot_restart.disk_save(plan, tmp_path, 3)
    _nodes(plan, shm, {5: PLACED})
    for lost in ("n1", "n2"):  # stage 1's holders (ranks 1 and 3) were on n1 and n2
        shutil.rmtree(shm / lost)
    assert _round(plan, tmp_path, ["n0"]) == {"n0": (str(disk), "")}
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "snapshots.key", "step-000003"]
    assert sorted(shm.rglob("*")) == [shm / "n0"]  # nothing held was worth keeping


@pytest.mark.parametrize("how", ["silent", "changed"])
def test_a_holder_lost_during_the_copy_makes_the_round_take_the_disk_save(tmp_path, monkeypatch, capsys, how):
    plan = _plan(tmp_path)
    shm = tmp_path / "shm"
    disk = snapshot_restart.disk_save(plan, tmp_path, 3)
    _nodes(plan, shm, {5: PLACED})
    shutil.rmtree(shm / "n2")
    if how == "silent":  # n1 said what it holds, then died before copying anything
        share = restart._copy_share
        monkeypatch.setattr(
            restart, "_copy_share", lambda store, node, *a: None if node == "n1" else share(store, node, *a)
        )
        why = "node n1 copied nothing for 1 s"
    else:  # n1's file changed since its record was written (same size)
        pt = folders.rank_file(folders.step_folder(shm / "n1" / "a-000000", 5), 1)
        data = bytearray(pt.read_bytes())
        data[-1] ^= 1
        pt.write_bytes(bytes(data))
        why = "CheckpointError: " + str(pt)
    # the silence waited out is 1 s where it is the case (n1's); else the round's usual 20 s, which only bounds a
    # hang (n0 must copy its own share within it: a loaded machine can stall a copy past 1 s)
    timeout_s = 1.0 if how == "silent" else 20.0
    assert _round(plan, tmp_path, ["n0", "n1"], timeout_s=timeout_s) == {n: (str(disk), "") for n in ("n0", "n1")}
    assert f"elastic: the snapshot of step 5 could not be copied into {tmp_path / 'ckpt' / 'step-000005'} ({why}" in (
        capsys.readouterr().err
    )
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "latest",
        "snapshots.key",
        "step-000003",
    ]  # no partial save
    assert folders.find(tmp_path / "ckpt").path == disk
    assert holders.held(shm / "n0", _key(tmp_path)) and holders.held(
        shm / "n1", _key(tmp_path)
    )  # kept: the next round chooses again


@pytest.mark.parametrize("restart, max_restarts, last", [("0", "0", True), ("1", "3", False), ("3", "3", True)])
def test_the_last_round_is_known_from_torchruns_restarts(restart, max_restarts, last):
    worker = elastic_worker.Worker(0, 1, 0, 1, "127.0.0.1", 1, int(restart))
    assert elastic_worker.last_round({"TORCHELASTIC_MAX_RESTARTS": max_restarts}, worker) is last
    assert elastic_worker.last_round({}, worker) is False
