"""The tests of tests/unit/test_input_safety.py that start processes or train for real (the integration tier).

Nothing a user gives is overwritten: no command writes over one of its inputs, no write follows a symbolic
link the program did not make, every output path is checked up front (one line, exit code 2, before any rank
starts or anything is written), and hetero-export / hetero-generate refuse a damaged save as --resume does."""

from __future__ import annotations

import os

import pytest
from helpers_input_safety import _export, _generate, ckpt, saved_run  # noqa: F401  (pytest fixtures)
from helpers_input_safety_paths import _elsewhere, _snapshot

from hetero_llm.interop import hf_names

NO_LINKS = "(writes never follow one: remove the link, or give another folder)"


def test_an_intact_save_still_exports_and_generates(ckpt, tmp_path):
    assert _export(ckpt, "--hf", tmp_path / "hf").exit_code == 0
    assert sorted(os.listdir(tmp_path / "hf")) == [hf_names.CONFIG, hf_names.WEIGHTS]
    result = _generate(ckpt, "--prompt", "1 2 3", "--max-new-tokens", "2", "--temperature", "0")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    "argument,out",
    [("ckpt", "ckpt"), ("ckpt", "ckpt/hf"), ("ckpt", "ckpt/step-000002"), ("ckpt/step-000002", "ckpt/step-000002/hf")],
)
def test_export_never_writes_into_the_checkpoint_it_reads(argument, out, ckpt, tmp_path):
    before = _snapshot(ckpt)
    result = _export(tmp_path / argument, "--hf", tmp_path / out)
    assert (result.exit_code, result.output) == (
        2,
        f"error: {tmp_path / out}: --hf: would write into CHECKPOINT_DIR "
        f"'{tmp_path / argument}', an input of this run (give another "
        "path)\n",
    )
    assert _snapshot(ckpt) == before


def test_export_never_writes_through_a_link(ckpt, tmp_path):
    target = _elsewhere(tmp_path)
    out = tmp_path / "hf"
    out.mkdir()
    (out / hf_names.CONFIG).symlink_to(target)
    result = _export(ckpt, "--hf", out)
    assert (result.exit_code, result.output) == (
        2,
        f"error: {out / hf_names.CONFIG}: --hf: is a symbolic link to '{target}' in the folder --hf writes into {NO_LINKS}\n",
    )
    linked = tmp_path / "linked_hf"
    linked.symlink_to(target.parent)
    result = _export(ckpt, "--hf", linked)
    assert (result.exit_code, result.output) == (
        2,
        f"error: {linked}: --hf: is a symbolic link to '{target.parent}' "
        "(writes never follow one: give the path it points to, or remove "
        "the link)\n",
    )
    assert _snapshot(target.parent) == {"precious.txt": b"not yours"} and os.listdir(out) == [hf_names.CONFIG]
