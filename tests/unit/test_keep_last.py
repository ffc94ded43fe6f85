"""Retention of saves and snapshots (``--keep-last N``; checkpoint/folders.py ``keep_count``, ``prune``;
checkpoint/snapshots.py): the newest N complete saves kept, never the one resumed from, a default that does not
fill the disk, a save half removed never resumed, a bad N in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.elastic import snapshot_restart
from harness import LAYOUTS, assert_one_error_line, common_sections, invoke_cli, write_layout
from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint import folders, snapshots, trust
from hetero_llm.errors import LayoutError

COMMON = common_sections(LAYOUTS / "reference" / "reference.toml")


def _saves(root: Path, steps, complete: bool = True) -> None:
    """Step folders of ``root`` at ``steps``, each with a rank file and (``complete``) a meta.json."""
    lay = layout_mod.load(str(write_layout(root.parent / "l.toml", COMMON, [(12, 3, [(6, 1)])])))
    for step in steps:
        folder = folders.step_folder(root, step)
        folder.mkdir(parents=True)
        folders.rank_file(folder, 0).write_bytes(b"x")
        if complete:
            folders.finish_save(folder, step, 1, lay)


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*"))


def test_the_newest_n_complete_saves_are_kept(tmp_path):
    root = tmp_path / "ck"
    _saves(root, [1, 2, 3, 4, 5])
    _saves(root, [6], complete=False)  # being written: no meta.json yet
    removed = folders.prune(root, 2)
    assert [p.name for p in removed] == ["step-000001", "step-000002", "step-000003"]
    assert _steps(root) == [4, 5, 6]
    assert folders.find(root).step == 5
    assert folders.prune(root, 0) == [] and _steps(root) == [4, 5, 6]  # 0: every save kept


def test_the_save_resumed_from_and_the_one_latest_names_are_never_removed(tmp_path):
    root = tmp_path / "ck"
    _saves(root, [1, 2, 3, 4])
    (root / folders.LATEST).write_text("step-000002\n")  # an older save named by latest (a later save interrupted)
    folders.prune(root, 1, protect=[str(folders.step_folder(root, 1))])
    assert _steps(root) == [1, 2, 4]


def test_a_save_half_removed_is_never_resumed(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    _saves(root, [1, 2, 3])
    (root / folders.LATEST).write_text("step-000003\n")

    def killed(folder) -> None:  # the pruning process dies right after a save's meta.json went
        raise KeyboardInterrupt

    monkeypatch.setattr(folders, "fsync_dir", killed)
    with pytest.raises(KeyboardInterrupt):
        folders.prune(root, 1)
    assert _steps(root) == [1, 2, 3] and not (folders.step_folder(root, 1) / folders.META).exists()
    (root / folders.LATEST).unlink()  # even without latest's word, the newest complete save is the one found
    monkeypatch.undo()
    assert folders.find(root).step == 3
    folders.prune(root, 1)  # the next save's pruning finishes the job (the half-removed one is no save any more)
    assert _steps(root) == [1, 3]


@pytest.mark.parametrize(
    "given, every, checkpoint, kept",
    [(None, 0, "ck", 0), (None, 1, "ck", folders.DEFAULT_KEEP), (5, 0, "ck", 5), (1, 1, "ck", 1)],
)
def test_the_number_of_saves_kept(given, every, checkpoint, kept):
    assert folders.keep_count("l.toml", given, every, checkpoint) == kept


@pytest.mark.parametrize(
    "given, checkpoint, message",
    [
        (
            0,
            "ck",
            "l.toml: --keep-last: '0' is not a number of saves >= 1 (the newest N complete saves are kept; without "
            "it 3 with --checkpoint-every, else every save)",
        ),
        (2, None, "l.toml: --keep-last: needs --checkpoint DIR (the folder whose saves it keeps)"),
    ],
)
def test_a_bad_keep_last_is_refused(given, checkpoint, message):
    with pytest.raises(LayoutError) as e:
        folders.keep_count("l.toml", given, 1, checkpoint)
    assert str(e.value) == message


def test_a_bad_keep_last_is_one_line(tmp_path):
    path = write_layout(tmp_path / "l.toml", COMMON, [(12, 3, [(6, 1)])])
    assert_one_error_line(
        invoke_cli(str(path), "--checkpoint", str(tmp_path / "ck"), "--keep-last", "-2"),
        f"{path}: --keep-last: '-2' is not a number of saves >= 1 (the newest N complete saves are kept; without it "
        "3 with --checkpoint-every, else every save)",
    )


def test_each_rank_keeps_as_many_snapshots_as_asked(tmp_path):
    plan = snapshot_restart.dp_pp_plan(tmp_path)
    rp, state, optimizer = snapshot_restart.rank_state(plan, 0)
    writer = snapshots.SnapshotWriter(rp, tmp_path / "round", trust.run_key(tmp_path / "ckpt"), keep=1)
    for step in (1, 2, 3):
        writer.take(state, optimizer, step)
    writer.wait()
    assert sorted(p.name for p in (tmp_path / "round").iterdir()) == ["step-000003"]


def test_a_bad_keep_last_is_one_line_under_elastic_too(tmp_path):
    from helpers_elastic import cluster_file

    path = cluster_file(tmp_path / "c.toml", 4)
    assert_one_error_line(
        invoke_cli(str(path), "--elastic", "--checkpoint", str(tmp_path / "ck"), "--keep-last", "0"),
        f"{path}: --keep-last: '0' is not a number of saves >= 1 (the newest N complete saves are kept; without it "
        "3 with --checkpoint-every, else every save)",
    )
