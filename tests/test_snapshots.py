"""In-memory snapshots of elastic runs (hetero_llm/checkpoint/snapshots.py), in one process: the background write,
its failure, what each rank keeps, and the restart's choice by holders (a snapshot step, else the disk's save).
The runs under torchrun: tests/test_elastic.py."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from harness import LAYOUTS, common_sections, write_layout
from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint import folders, shards, snapshots
from hetero_llm.errors import RankFailure
from hetero_llm.launch import elastic
from hetero_llm.plan import compile_plan
from hetero_llm.runtime.state import init_state, make_optimizer

COMMON = common_sections(LAYOUTS / "reference" / "reference.toml").replace("steps = 3", "steps = 20")


def _plan(tmp_path: Path):
    """Two DP pipelines of two stages each: every parameter block has two holders (ranks 0 and 2, 1 and 3)."""
    path = write_layout(tmp_path / "dp.toml", COMMON, [(6, 3, [(3, 1), (3, 1)]), (6, 3, [(3, 1), (3, 1)])])
    return compile_plan(layout_mod.load(str(path)))


def _rank(plan, rank: int):
    """A rank's state and an optimizer with moments (one step on made-up gradients)."""
    rp = plan.rank_plan(rank)
    state = init_state(rp, torch.device("cpu"))
    optimizer = make_optimizer(state, rp.train)
    for p in state.params.values():
        p.grad = torch.full_like(p, 0.01)  # DP replicas hold the same values, as in training
    optimizer.step()
    return rp, state, optimizer


def _snapshot(plan, root: Path, step: int, ranks=None) -> dict:
    """Every rank (or ``ranks``) of ``plan`` snapshots at ``step`` into ``root``; their states by rank."""
    states = {}
    for r in range(plan.world_size) if ranks is None else ranks:
        rp, state, optimizer = _rank(plan, r)
        writer = snapshots.SnapshotWriter(rp, root)
        writer.take(state, optimizer, step)
        writer.wait()
        states[r] = (state, optimizer)
    return states


def _drop(root: Path, step: int, rank: int) -> None:
    pt = folders.rank_file(folders.step_folder(root, step), rank)
    pt.with_suffix(".json").unlink()
    pt.unlink()


def test_a_snapshot_is_written_in_the_background_and_visible_only_when_whole(tmp_path, monkeypatch):
    plan = _plan(tmp_path)
    rp, state, optimizer = _rank(plan, 1)
    release, digest = threading.Event(), folders.file_digest
    monkeypatch.setattr(snapshots.folders, "file_digest", lambda path: (release.wait(30), digest(path))[1])
    writer = snapshots.SnapshotWriter(rp, tmp_path / "round")
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
    writer = snapshots.SnapshotWriter(rp, tmp_path / "shm" / "round")
    writer.take(state, optimizer, 2)
    device = plan.ranks[1].device_id
    with pytest.raises(RankFailure, match=rf"^rank 1 \({device}\) could not write its snapshot of step 2 into "):
        writer.wait()


def test_each_rank_keeps_its_two_newest_snapshots(tmp_path):
    plan = _plan(tmp_path)
    rp, state, optimizer = _rank(plan, 0)
    writer = snapshots.SnapshotWriter(rp, tmp_path / "round")
    for step in (1, 2, 3):
        writer.take(state, optimizer, step)
    writer.wait()
    assert sorted(p.name for p in (tmp_path / "round").iterdir()) == ["step-000002", "step-000003"]


def test_a_restart_resumes_the_newest_step_every_block_has_a_holder_of(tmp_path):
    plan = _plan(tmp_path)
    lay = plan.layout
    base = tmp_path / "shm"
    states = _snapshot(plan, base / "a-000000", 5)
    _snapshot(plan, base / "a-000000", 6, ranks=[0, 2])  # a node lost while step 6 was written: stage 1 missing
    _drop(base / "a-000000", 5, 1)  # rank 1's snapshot gone too: rank 3 holds the same blocks
    sealed = snapshots.seal_newest(base, lay, newer_than=3)
    assert sealed is not None and Path(sealed).name == "step-000005"
    assert folders.verify(folders.find(sealed)) is None  # a complete save: sizes, sha256, every block covered
    assert sorted(p.name for p in base.iterdir()) == [snapshots.SEALED]  # the rest removed
    one = compile_plan(layout_mod.load(str(write_layout(tmp_path / "one.toml", COMMON, [(12, 3, [(6, 1)])]))))
    restored = shards.restore(one.rank_plan(0), sealed)  # any layout resumes it, as a disk save
    assert restored.step == 5
    held = {name: (s, o) for s, o in (states[0], states[3]) for name in s.params}
    for name, t in restored.shards["tensor"].items():
        state, optimizer = held[name]
        p = state.params[name]
        assert torch.equal(t, p.detach()), name
        assert torch.equal(restored.shards["exp_avg"][name], optimizer.state[p]["exp_avg"]), name
    # the next round finds the sealed save again (nothing newer was written)
    assert snapshots.seal_newest(base, lay, newer_than=3) == sealed
    assert snapshots.seal_newest(base, lay, newer_than=5) is None  # the disk's save is as new: it is taken


def test_without_a_holder_for_every_block_the_restart_takes_the_disk_save(tmp_path):
    plan = _plan(tmp_path)
    lay = plan.layout
    disk = tmp_path / "disk"  # a complete save at step 3 (a sealed snapshot is one, in the checkpoint format)
    _snapshot(plan, disk / "a-000000", 3)
    snapshots.seal_newest(disk, lay, newer_than=-1)
    shutil.move(disk / snapshots.SEALED / "step-000003", tmp_path / "ckpt" / "step-000003")
    base = tmp_path / "shm"
    _snapshot(plan, base / "a-000000", 5)
    assert elastic.newest_save(lay, str(tmp_path / "ckpt"), base) == (
        str(base / snapshots.SEALED / "step-000005"),
        " from a snapshot in memory",
    )
    _snapshot(plan, base / "b-000005", 7, ranks=[0, 1, 2])
    _drop(base / "b-000005", 7, 1)  # stage 1 of step 7: neither rank 1 nor rank 3 holds it
    resume, source = elastic.newest_save(lay, str(tmp_path / "ckpt"), base)
    assert (resume, source) == (str(base / snapshots.SEALED / "step-000005"), " from a snapshot in memory")
    shutil.rmtree(base / snapshots.SEALED)  # and without that one: the disk's
    _snapshot(plan, base / "b-000005", 7, ranks=[0, 2])
    resume, source = elastic.newest_save(lay, str(tmp_path / "ckpt"), base)
    assert (Path(resume or "").name, source) == ("step-000003", "")
    assert list(base.iterdir()) == []  # nothing in memory was worth keeping


@pytest.mark.parametrize("restart, max_restarts, last", [("0", "0", True), ("1", "3", False), ("3", "3", True)])
def test_the_last_round_is_known_from_torchruns_restarts(restart, max_restarts, last):
    worker = elastic.Worker(0, 1, 0, 1, "127.0.0.1", 1, int(restart))
    assert elastic.last_round({"TORCHELASTIC_MAX_RESTARTS": max_restarts}, worker) is last
    assert elastic.last_round({}, worker) is False
