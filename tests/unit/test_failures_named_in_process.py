"""The tests of tests/integration/test_failures_named.py that run in this process (the unit tier).

Failures a user causes or meets are named, promptly, in one line (docs/guarantees.md, "Failures are named,
promptly"): a foreign server on the rendezvous port, the rank serving the store killed under the others, a
disk that fills up during a save. Each is reproduced as a user meets it; each line is checked whole.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess

import pytest

from harness import LAYOUTS
from hetero_llm import _fs
from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint import folders
from hetero_llm.errors import CheckpointError

REFERENCE = LAYOUTS / "reference" / "reference.toml"  # one rank


def test_a_full_disk_writing_meta_json_is_named_and_latest_stays(tmp_path, monkeypatch):
    """The small files of a save (meta.json, latest) with ENOSPC injected at their fsync (as a network or a
    quota-limited filesystem reports it), where a tmpfs cannot be mounted: the same line, no temporary file."""
    lay = layout_mod.load(REFERENCE)
    for step in (2, 4):
        folders.step_folder(tmp_path, step).mkdir()
    folders.finish_save(folders.step_folder(tmp_path, 2), 2, 1, lay)
    folder = folders.step_folder(tmp_path, 4)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_fs.os, "fsync", full)
    with pytest.raises(CheckpointError) as err:
        folders.finish_save(folder, 4, 1, lay)
    monkeypatch.undo()
    meta = folder / "meta.json"
    needed = (tmp_path / "step-000002" / "meta.json").stat().st_size  # step 4's: the same but for one digit
    source, mounted_on = (
        subprocess.run(["df", "--output=source,target", str(tmp_path)], capture_output=True, text=True, check=True)
        .stdout.splitlines()[1]
        .split()
    )
    match = re.fullmatch(
        re.escape(
            f"{tmp_path}: --checkpoint: no space left on {source} at {mounted_on} writing {meta} "
            f"({needed / 1e6:.1f} MB needed, "
        )
        + r"(\d+\.\d) MB free"
        + re.escape(": free space or give --checkpoint another disk)"),
        str(err.value),
    )
    assert match, err.value
    free = _fs.free_bytes(tmp_path) / 1e6  # a disk other programs write to meanwhile: close, not equal
    assert abs(float(match[1]) - free) <= max(1.0, free / 100)
    assert (tmp_path / "latest").read_text() == "step-000002\n"  # still the save before
    assert list(folder.iterdir()) == []  # no meta.json.tmp
