"""Checkpoints without processes: which save ``--resume`` picks, slicing saved shards for another layout,
restoring either AdamW, and every bad ``--resume`` as one exact line (exit code 2, before any rank starts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetero_llm import checkpoint, layout as layout_mod
from hetero_llm.errors import CheckpointError
from hetero_llm.optim import AdamW
from hetero_llm.train import _assemble, _optimizer_steps, _restore_optimizer
from harness import LAYOUTS, ROOT, assert_one_error_line, invoke_cli

REFERENCE = LAYOUTS / "reference.toml"  # 6 layers, hidden 32; train.steps = 3
FOLDER = Path("ckpt/step-000002")


def _save(root: Path, step: int, lay: layout_mod.Layout, world_size: int = 1, complete: bool = True) -> Path:
    """A save's files as the CLI sees them (it reads meta.json and checks that every rank file is there)."""
    folder = checkpoint.step_folder(root, step)
    checkpoint.begin_save(folder)
    for r in range(world_size):
        checkpoint.rank_file(folder, r).write_bytes(b"")
    if complete:
        checkpoint.finish_save(folder, step, world_size, lay)
    return folder


# ------------------------------------------------------------------------------------ which save


def test_root_means_latest(tmp_path):
    lay = layout_mod.load(REFERENCE)
    _save(tmp_path, 1, lay)
    two = _save(tmp_path, 2, lay)
    assert (tmp_path / "latest").read_text() == "step-000002\n"
    assert checkpoint.find(tmp_path).path == two
    assert checkpoint.find(tmp_path).step == 2


def test_interrupted_save_is_never_picked(tmp_path):
    """A crash mid-save leaves its folder without meta.json and ``latest`` on the save before."""
    lay = layout_mod.load(REFERENCE)
    two = _save(tmp_path, 2, lay)
    _save(tmp_path, 4, lay, complete=False)
    assert checkpoint.find(tmp_path).path == two


def test_latest_naming_an_interrupted_resave_falls_back_to_the_newest_complete_folder(tmp_path):
    """A resumed run saving into a step folder again unmarks it first; interrupted, ``latest`` names it."""
    lay = layout_mod.load(REFERENCE)
    _save(tmp_path, 2, lay)
    three = _save(tmp_path, 3, lay)
    four = _save(tmp_path, 4, lay)
    checkpoint.begin_save(four)
    assert not (four / "meta.json").exists()
    assert (tmp_path / "latest").read_text() == "step-000004\n"
    assert checkpoint.find(tmp_path).path == three


def test_step_folder_means_itself(tmp_path):
    lay = layout_mod.load(REFERENCE)
    one = _save(tmp_path, 1, lay, world_size=3)
    _save(tmp_path, 2, lay)
    found = checkpoint.find(one)
    assert (found.path, found.step, found.world_size, found.layout) == (one, 1, 3, str(REFERENCE))
    assert found.shapes["layers.0.attn.wq"] == (32, 32)


# ------------------------------------------------------------------------------------ slicing


def _shard(full: torch.Tensor, dim: int | None, lo: int, hi: int) -> dict:
    tensor = full if dim is None else full.narrow(dim, lo, hi - lo)
    return {"tensor": tensor.clone(), "coords": (dim, lo, hi, tuple(full.shape))}


def test_slices_cut_across_shard_boundaries():
    """Shards saved by TP 2 (rows [0, 3), [3, 6)) give a TP-3 rank rows [2, 4): parts of both."""
    gen = torch.Generator().manual_seed(0)
    w, wo, norm = torch.randn(6, 4, generator=gen), torch.randn(4, 6, generator=gen), torch.randn(6, generator=gen)
    files = [{"shards": {"w": _shard(w, 0, 0, 3), "wo": _shard(wo, 1, 0, 3), "norm": _shard(norm, None, 0, 6)}},
             {"shards": {"w": _shard(w, 0, 3, 6), "wo": _shard(wo, 1, 3, 6), "norm": _shard(norm, None, 0, 6)}}]
    got = _assemble(files, {"w": (2, 4), "wo": (4, 6), "norm": (0, 6)}, ("tensor",), FOLDER)["tensor"]
    assert torch.equal(got["w"], w[2:4])
    assert torch.equal(got["wo"], wo[:, 4:6])
    assert torch.equal(got["norm"], norm)
    full = _assemble(files, {"w": None, "wo": None, "norm": None}, ("tensor",), FOLDER)["tensor"]
    assert all(torch.equal(full[n], t) for n, t in (("w", w), ("wo", wo), ("norm", norm)))


def test_rows_in_no_rank_file_are_an_error():
    files = [{"shards": {"w": _shard(torch.randn(6, 4), 0, 0, 3)}}]
    with pytest.raises(CheckpointError) as e:
        _assemble(files, {"w": (2, 4)}, ("tensor",), FOLDER)
    assert str(e.value) == (f"{FOLDER}: --resume: w: part of it is in no rank file (the save is damaged); "
                            "resume from another step folder")


# ------------------------------------------------------------------------------------ AdamW state


def _adamw(kind: str, params: list[torch.Tensor]):
    groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    # CUDA ranks use torch's fused AdamW; it runs on CPU too, so its state handling is tested here
    return AdamW(groups, **kw) if kind == "ours" else torch.optim.AdamW(groups, fused=True, **kw)


@pytest.mark.parametrize("kind", ["ours", "torch fused"])
def test_restored_adamw_continues_like_the_uninterrupted_one(kind):
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(7, 5, generator=gen), torch.randn(11, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in start] for _ in range(4)]

    def steps(opt, params, gs):
        for g in gs:
            for p, gi in zip(params, g):
                p.grad = gi.clone()
            opt.step()

    whole = [p.clone().requires_grad_() for p in start]
    steps(_adamw(kind, whole), whole, grads)

    first = [p.clone().requires_grad_() for p in start]
    opt = _adamw(kind, first)
    steps(opt, first, grads[:2])
    saved = {key: {str(i): opt.state[p][key].clone() for i, p in enumerate(first)} for key in ("exp_avg", "exp_avg_sq")}
    assert _optimizer_steps(opt) == 2
    resumed = [p.detach().clone().requires_grad_() for p in first]
    opt = _adamw(kind, resumed)
    _restore_optimizer(opt, {str(i): p for i, p in enumerate(resumed)}, saved, 2)
    assert _optimizer_steps(opt) == 2
    steps(opt, resumed, grads[2:])
    for p, q in zip(resumed, whole):
        assert torch.equal(p, q)


# ------------------------------------------------------------------------------------ bad --resume


FIX = ("pass the --checkpoint DIR of an earlier run or one of its step-NNNNNN folders, "
       "or start without --resume")


def test_resume_from_a_missing_folder(tmp_path):
    assert_one_error_line(invoke_cli(REFERENCE, "--resume", tmp_path / "nope"),
                          f"{tmp_path / 'nope'}: --resume: no such folder ({FIX})")


def test_resume_from_a_folder_without_a_complete_save(tmp_path):
    _save(tmp_path, 2, layout_mod.load(REFERENCE), complete=False)
    assert_one_error_line(invoke_cli(REFERENCE, "--resume", tmp_path),
                          f"{tmp_path}: --resume: no complete checkpoint here (no step-NNNNNN folder with a "
                          f"meta.json; a save interrupted before writing it does not count): {FIX}")
    assert_one_error_line(invoke_cli(REFERENCE, "--resume", tmp_path / "step-000002"),
                          f"{tmp_path / 'step-000002'}: --resume: an incomplete save (no meta.json: it was "
                          "interrupted); pass its parent folder to resume from the newest complete save")


def test_resume_with_a_rank_file_missing(tmp_path):
    folder = _save(tmp_path, 2, layout_mod.load(REFERENCE), world_size=3)
    (folder / "rank1.pt").unlink()
    assert_one_error_line(invoke_cli(REFERENCE, "--resume", tmp_path),
                          f"{folder}: --resume: rank1.pt is missing (the layout that saved it had 3 ranks); {FIX}")


@pytest.mark.parametrize("overrides,difference", [
    (["model.hidden=48"], "embed.tok is [64, 48] in the layout's model but [64, 32] in the checkpoint"),
    (["model.layers=7", "pipelines.0.stages.0.layers=7"],
     "the checkpoint lacks layers.6.attn_norm.weight, layers.6.attn.wq and 7 more"),
    (["model.layers=5", "pipelines.0.stages.0.layers=5"],
     "the layout's model lacks layers.5.attn_norm.weight, layers.5.attn.wq and 7 more"),
], ids=["other hidden size", "more layers", "fewer layers"])
def test_resume_a_checkpoint_of_another_model(overrides, difference, tmp_path):
    folder = _save(tmp_path, 2, layout_mod.load(REFERENCE))
    sets = [a for o in overrides for a in ("--set", o)]
    assert_one_error_line(invoke_cli(REFERENCE, *sets, "--resume", tmp_path),
                          f"{folder}: --resume: a checkpoint of a different model than {REFERENCE}'s: {difference} "
                          "(resume with the [model] it was trained with, or start without --resume)")


def test_resume_with_nothing_left_to_train(tmp_path):
    folder = _save(tmp_path, 3, layout_mod.load(REFERENCE))
    assert_one_error_line(invoke_cli(REFERENCE, "--resume", tmp_path),
                          f"{folder}: --resume: the checkpoint is at step 3 and train.steps is 3: nothing left to "
                          "train (raise it, e.g. --set train.steps=6)")


def test_checkpoint_every_needs_a_folder():
    assert_one_error_line(invoke_cli(REFERENCE, "--checkpoint-every", "2"),
                          f"{REFERENCE}: --checkpoint-every: needs --checkpoint DIR (the folder to save into)")


def test_bad_resume_in_a_real_process(tmp_path):
    """Once outside CliRunner: one line on stderr, exit code 2, no traceback, no rank started."""
    proc = subprocess.run([sys.executable, "-m", "hetero_llm.cli", str(REFERENCE), "--resume", str(tmp_path / "nope")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"error: {tmp_path / 'nope'}: --resume: no such folder ({FIX})\n"
