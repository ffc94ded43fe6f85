"""Snapshots another local user could plant or read (hetero_llm/checkpoint/trust.py; snapshots.py, holders.py,
launch/restart.py): the snapshot folder's name is computed from the --checkpoint path, so anyone can make it first.
Each harmful case is planted and must be refused: a snapshot another user wrote (a record that looks right but is
not vouched for by the run's key), snapshots the run itself signed that --resume would refuse (NaN, a wrong shape,
a pickle, an empty file, step 999999: never sealed), a symbolic link or another user's or a world-writable folder
where the snapshot folder goes, the key itself exposed; and the run's own files are private. The tests run as root:
"another user" is uid 65534 (nobody), given by os.chown. The one-line refusals through the CLI:
tests/unit/test_elastic.py."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from pathlib import Path

import pytest
import torch

from bench.elastic import snapshot_restart
from hetero_llm.checkpoint import folders, snapshots, trust
from hetero_llm.errors import CheckpointError, RankFailure

NOBODY = 65534
ALL = {"n0": [0, 1, 2, 3]}  # every rank of the plan on one node


def _plan(tmp_path: Path):
    return snapshot_restart.dp_pp_plan(tmp_path)


def _round(plan, tmp_path: Path) -> tuple:
    """One round of node n0 alone (its snapshot folder ``shm/n0``): what ``restart.agree`` returned."""
    result = snapshot_restart.agree_round(plan, tmp_path / "ckpt", tmp_path / "shm", ["n0"], 20.0)["n0"]
    assert not isinstance(result[0], Exception), result
    return result[0]


def _ckpt(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "ckpt").iterdir())


def _rank_file(tmp_path: Path, step: int, rank: int) -> Path:
    return folders.rank_file(folders.step_folder(tmp_path / "shm" / "n0" / "a-000000", step), rank)


def _rewrite(pt: Path, data: bytes, key: bytes | None) -> None:
    """Replace snapshot file ``pt`` by ``data`` and give it a record that matches it (its size, its sha256):
    signed with ``key`` (the run's, or another's), or with no MAC at all (None)."""
    pt.write_bytes(data)
    record = json.loads(pt.with_suffix(".json").read_text())
    record.pop("mac")
    record.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    if key is not None:
        record["mac"] = trust.sign(key, record, f"a-000000/{pt.parent.name}/{pt.stem}")
    pt.with_suffix(".json").write_text(json.dumps(record))


def _saved(pt: Path) -> dict:
    return torch.load(pt, weights_only=True)


def _torch_bytes(value) -> bytes:
    import io

    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


@pytest.mark.parametrize("mac", ["none", "another key"])
def test_a_planted_snapshot_is_removed_and_never_resumed(tmp_path, capfd, mac):
    """Constant weights at a newer step, with records whose size and sha256 match their files, as the run's own
    would: without the run's key they vouch for nothing."""
    plan = _plan(tmp_path)
    disk = snapshot_restart.disk_save(plan, tmp_path, 3)
    other = hashlib.sha256(b"another user").digest()
    snapshot_restart.snapshot_ranks(plan, tmp_path / "shm" / "n0" / "a-000000", 5, range(4), other)
    for rank in range(4):
        pt = _rank_file(tmp_path, 5, rank)
        saved = _saved(pt)
        for shard in saved["shards"].values():
            shard["tensor"].fill_(0.5)
        _rewrite(pt, _torch_bytes(saved), other if mac == "another key" else None)
    assert _round(plan, tmp_path) == (str(disk), "")
    err = capfd.readouterr().err
    for rank in range(4):
        assert (
            f"elastic: {_rank_file(tmp_path, 5, rank)}: removed, never resumed: its record is not vouched for by "
            "this run's key (--checkpoint DIR/snapshots.key): another user's file, or another run's\n"
        ) in err
    assert _ckpt(tmp_path) == ["latest", "snapshots.key", "step-000003"]  # nothing sealed
    assert folders.find(tmp_path / "ckpt").path == disk
    assert list((tmp_path / "shm").rglob("*")) == [tmp_path / "shm" / "n0"]  # emptied


def _nan(saved: dict) -> dict:
    next(iter(saved["shards"].values()))["exp_avg"][0] = float("nan")
    return saved


def _reshaped(saved: dict) -> dict:
    shard = next(iter(saved["shards"].values()))
    shard["tensor"] = torch.zeros(*[n + 1 for n in shard["tensor"].shape])
    return saved


class _Evil:
    def __reduce__(self):
        return (os.getpid, ())  # harmless here; a planted pickle would run anything


BAD = {
    "NaN": (lambda pt: _torch_bytes(_nan(_saved(pt))), "the exp_avg of {name} holds NaN or infinite values"),
    "wrong shape": (lambda pt: _torch_bytes(_reshaped(_saved(pt))), "its {name} is [["),
    "pickle": (lambda pt: _torch_bytes({**_saved(pt), "evil": _Evil()}), "cannot be read (UnpicklingError"),
    "empty": (lambda pt: b"", "cannot be read ("),
}


@pytest.mark.parametrize("case", [*BAD, "step 999999"])
def test_a_snapshot_resume_would_refuse_is_never_sealed(tmp_path, capfd, case):
    """Even vouched for by the run's key (its own diverged state, or a key that leaked), a snapshot that --resume
    would refuse is refused before it is sealed: removed from DIR and from memory, in one line, and the round
    resumes from the disk save; the next round and --resume auto still work."""
    plan = _plan(tmp_path)
    disk = snapshot_restart.disk_save(plan, tmp_path, 3)
    key = trust.run_key(tmp_path / "ckpt")
    step = 999999 if case == "step 999999" else 5
    snapshot_restart.snapshot_ranks(plan, tmp_path / "shm" / "n0" / "a-000000", step, range(4), key)
    pt = _rank_file(tmp_path, step, 1)
    name = next(iter(_saved(pt)["shards"]))
    if case in BAD:
        make, why = BAD[case]
        _rewrite(pt, make(pt), key)
    else:
        why = "the checkpoint is at step 999999 and train.steps is 20: nothing left to train"
    folder = folders.step_folder(tmp_path / "ckpt", step)
    assert _round(plan, tmp_path) == (str(disk), "")
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("elastic:")]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"elastic: the snapshot of step {step} is refused (CheckpointError: "), lines[0]
    assert why.format(name=name) in lines[0], lines[0]
    assert lines[0].endswith(f"); removed from {folder} and from the nodes' memory, resuming from {disk} instead")
    assert _ckpt(tmp_path) == ["latest", "snapshots.key", "step-000003"]
    assert folders.find(tmp_path / "ckpt").path == disk
    assert list((tmp_path / "shm").rglob("*")) == [tmp_path / "shm" / "n0"]  # emptied: not chosen again
    assert _round(plan, tmp_path) == (str(disk), "")


def test_the_runs_own_snapshots_and_key_are_private(tmp_path):
    plan = _plan(tmp_path)
    rp, state, optimizer = snapshot_restart.rank_state(plan, 1)
    key = trust.run_key(tmp_path / "ckpt")
    base = trust.private_folder(tmp_path / "shm" / "n0")
    writer = snapshots.SnapshotWriter(rp, base / "a-000000", key)
    writer.take(state, optimizer, 2)
    writer.wait()
    modes = {
        str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode)
        for p in [base, *sorted(base.rglob("*")), tmp_path / "ckpt" / trust.KEY]
    }
    assert modes == {
        "shm/n0": 0o700,
        "shm/n0/a-000000": 0o700,
        "shm/n0/a-000000/step-000002": 0o700,
        "shm/n0/a-000000/step-000002/rank1.json": 0o600,
        "shm/n0/a-000000/step-000002/rank1.pt": 0o600,
        "ckpt/snapshots.key": 0o600,
    }
    assert trust.run_key(tmp_path / "ckpt") == key  # every worker of every round reads the same key


def test_workers_racing_to_make_the_key_all_get_the_same_one(tmp_path):
    keys: list[bytes] = []
    threads = [threading.Thread(target=lambda: keys.append(trust.run_key(tmp_path / "ckpt"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(keys) == 8 and len(set(keys)) == 1 and len(keys[0]) == 32
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["snapshots.key"]  # no temporary file left


def _foreign(path: Path) -> Path:
    path.mkdir()
    os.chown(path, NOBODY, NOBODY)
    return path


FOLDERS = {
    "a symbolic link": (
        lambda d: (d / "shm").symlink_to(_foreign(d / "theirs")),
        "is a symbolic link to '{d}/theirs' (snapshots are never written through one: remove it",
    ),
    "another user's folder": (
        lambda d: _foreign(d / "shm"),
        "belongs to uid 65534, not to this user (uid 0): another user made it (remove it",
    ),
    "a folder anyone may write": (
        lambda d: ((d / "shm").mkdir(), os.chmod(d / "shm", 0o777)),
        "is writable by group or others (mode 777; remove it",
    ),
}


@pytest.mark.skipif(
    os.geteuid() != 0,
    reason="making a folder another user's needs root: runs in CI and on the dev machines, which run as root",
)
@pytest.mark.parametrize("case", FOLDERS)
def test_a_snapshot_folder_another_user_controls_is_refused(tmp_path, case):
    """Refused where the round checks the folder (``trust.private_folder``) and where a rank writes into it: no
    weight or moment is written into it."""
    plant, why = FOLDERS[case]
    plant(tmp_path)
    message = f"{tmp_path / 'shm'}: --snapshot-every: {why.format(d=tmp_path)}, or set HETERO_SHM_DIR to a folder "
    with pytest.raises(CheckpointError) as refused:
        trust.private_folder(tmp_path / "shm")
    assert str(refused.value) == message + "of your own)"
    plan = _plan(tmp_path)
    rp, state, optimizer = snapshot_restart.rank_state(plan, 0)
    writer = snapshots.SnapshotWriter(rp, tmp_path / "shm" / "a-000000", trust.run_key(tmp_path / "ckpt"))
    writer.take(state, optimizer, 1)
    with pytest.raises(RankFailure, match="could not write its snapshot of step 1 into .*CheckpointError: "):
        writer.wait()
    assert list((tmp_path / "shm").iterdir()) == []


def test_an_own_folder_others_may_read_is_made_private(tmp_path):
    (tmp_path / "shm").mkdir(mode=0o755)
    os.chmod(tmp_path / "shm", 0o755)  # an earlier hetero_llm made it so
    trust.private_folder(tmp_path / "shm")
    assert stat.S_IMODE((tmp_path / "shm").stat().st_mode) == 0o700


KEYS = {
    "readable by others": (lambda key: os.chmod(key, 0o644), "is readable or writable by group or others (mode 644)"),
    "another user's": (lambda key: os.chown(key, NOBODY, NOBODY), "belongs to uid 65534, not to this user (uid 0)"),
    "a symbolic link": (lambda key: (key.unlink(), key.symlink_to(key.parent / "elsewhere")), "is a symbolic link"),
    "not a key": (lambda key: key.write_text("0123"), "is not a key (64 hex digits)"),
}


@pytest.mark.skipif(
    os.geteuid() != 0,
    reason="making a file another user's needs root: runs in CI and on the dev machines, which run as root",
)
@pytest.mark.parametrize("case", KEYS)
def test_an_exposed_or_foreign_key_is_refused(tmp_path, case):
    key = tmp_path / "ckpt" / trust.KEY
    trust.run_key(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "elsewhere").write_text("ab" * 32)
    spoil, why = KEYS[case]
    spoil(key)
    with pytest.raises(CheckpointError) as refused:
        trust.run_key(tmp_path / "ckpt")
    assert str(refused.value) == (
        f"{key}: --snapshot-every: {why}: it is this run's snapshot key, which only this user may read (delete it: "
        "a new one is made, and the snapshots in memory are not resumed)"
    )


def test_a_checkpoint_folder_that_is_a_link_gets_no_key(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "ckpt").symlink_to(tmp_path / "real")
    with pytest.raises(CheckpointError) as refused:
        trust.run_key(tmp_path / "ckpt")
    assert str(refused.value) == (
        f"{tmp_path / 'ckpt'}: --checkpoint: is a symbolic link to '{tmp_path / 'real'}' (writes never follow one: "
        "give the path it points to)"
    )
    assert list((tmp_path / "real").iterdir()) == []
