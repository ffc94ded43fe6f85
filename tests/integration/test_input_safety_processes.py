"""The tests of tests/unit/test_input_safety.py that start processes or train for real (the integration tier).

Nothing a user gives is overwritten: no command writes over one of its inputs, no write follows a symbolic
link the program did not make, every output path is checked up front (one line, exit code 2, before any rank
starts or anything is written), and hetero-export / hetero-generate refuse a damaged save as --resume does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_input_safety import _export, _generate, ckpt, saved_run  # noqa: F401  (pytest fixtures)

from harness import LAYOUTS
from harness import invoke_cli as invoke
from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint import folders
from hetero_llm.errors import CheckpointError

REFERENCE = LAYOUTS / "reference" / "reference.toml"


def _rerecord(folder: Path) -> None:
    """Record rank0.pt's current size and sha256 in meta.json, as if it had been saved so."""
    meta = json.loads((folder / folders.META).read_text())
    size, sha = folders.file_digest(folder / "rank0.pt")
    meta["files"]["rank0.pt"].update(bytes=size, sha256=sha)
    (folder / folders.META).write_text(json.dumps(meta))


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-4])


def _nan_in_a_tensor(path: Path) -> None:
    import torch

    saved = torch.load(path, weights_only=True)
    saved["shards"]["layers.0.attn.wq"]["tensor"][0, 0] = float("nan")
    torch.save(saved, path)
    _rerecord(path.parent)  # its checksum matches: only the values give it away


def _resume_error(ckpt: Path) -> str:
    """What ``hetero-launch --resume`` says of the save: the CLI's line before any rank starts, or (a save whose
    records match) the resumed rank's own refusal."""
    from hetero_llm.checkpoint import shards
    from hetero_llm.plan import compile_plan

    result = invoke(REFERENCE, "--dry-run", "--resume", ckpt)
    if result.exit_code:
        assert result.exit_code == 2 and result.stderr.startswith("error: "), result.stderr
        return result.stderr[len("error: ") :].rstrip("\n")
    with pytest.raises(CheckpointError) as e:
        shards.restore(compile_plan(layout_mod.load(REFERENCE)).rank_plan(0), str(ckpt))
    return str(e.value)


@pytest.mark.parametrize("damage", [_flip_a_bit, _truncate, _nan_in_a_tensor], ids=["bit flip", "truncated", "NaN"])
def test_export_and_generate_refuse_a_damaged_save_as_resume_does(damage, ckpt, tmp_path):
    damage(ckpt / "step-000002" / "rank0.pt")
    resume = _resume_error(ckpt)
    assert ": --resume: " in resume and resume.endswith(folders.DAMAGED)
    # the same line, located at the command's argument, its fix naming what these commands can do instead
    expected = resume.replace(": --resume: ", ": CHECKPOINT_DIR: ").replace(folders.DAMAGED, "pass another step folder")
    for result in (
        _export(ckpt, "--hf", tmp_path / "hf"),
        _generate(ckpt, "--prompt", "1 2 3", "--max-new-tokens", "2"),
    ):
        assert (result.exit_code, result.output) == (2, f"error: {expected}\n")
    assert not (tmp_path / "hf").exists()
