"""Checkpoints without processes: which save ``--resume`` picks, slicing saved shards for another layout,
restoring either AdamW, and every bad ``--resume`` as one exact line (exit code 2, before any rank starts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import LAYOUTS, assert_one_error_line, invoke_cli
from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint import folders
from hetero_llm.checkpoint.shards import _assemble, optimizer_steps, restore_optimizer
from hetero_llm.errors import CheckpointError
from hetero_llm.runtime.adamw import AdamW

REFERENCE = LAYOUTS / "reference" / "reference.toml"  # 6 layers, hidden 32; train.steps = 3

FOLDER = Path("ckpt/step-000002")


def _save(root: Path, step: int, lay: layout_mod.Layout, world_size: int = 1, complete: bool = True) -> Path:
    """A save's files as the CLI sees them (it reads meta.json and checks that every rank file is there)."""
    folder = folders.step_folder(root, step)
    folders.begin_save(folder)
    for r in range(world_size):
        folders.rank_file(folder, r).write_bytes(b"")
    if complete:
        folders.finish_save(folder, step, world_size, lay)
    return folder


def test_root_means_latest(tmp_path):
    lay = layout_mod.load(REFERENCE)
    _save(tmp_path, 1, lay)
    two = _save(tmp_path, 2, lay)
    assert (tmp_path / "latest").read_text() == "step-000002\n"
    assert folders.find(tmp_path).path == two
    assert folders.find(tmp_path).step == 2


def test_interrupted_save_is_never_picked(tmp_path):
    """A crash mid-save leaves its folder without meta.json and ``latest`` on the save before."""
    lay = layout_mod.load(REFERENCE)
    two = _save(tmp_path, 2, lay)
    _save(tmp_path, 4, lay, complete=False)
    assert folders.find(tmp_path).path == two


def test_latest_naming_an_interrupted_resave_falls_back_to_the_newest_complete_folder(tmp_path):
    """A resumed run saving into a step folder again unmarks it first; interrupted, ``latest`` names it."""
    lay = layout_mod.load(REFERENCE)
    _save(tmp_path, 2, lay)
    three = _save(tmp_path, 3, lay)
    four = _save(tmp_path, 4, lay)
    folders.begin_save(four)
    assert not (four / "meta.json").exists()
    assert (tmp_path / "latest").read_text() == "step-000004\n"
    assert folders.find(tmp_path).path == three


def test_step_folder_means_itself(tmp_path):
    lay = layout_mod.load(REFERENCE)
    one = _save(tmp_path, 1, lay, world_size=3)
    _save(tmp_path, 2, lay)
    found = folders.find(one)
    assert (found.path, found.step, found.world_size, found.layout) == (one, 1, 3, str(REFERENCE))
    assert found.shapes["layers.0.attn.wq"] == (32, 32)


def _shard(full: torch.Tensor, dim: int | None, lo: int, hi: int) -> dict:
    tensor = full if dim is None else full.narrow(dim, lo, hi - lo)
    return {"tensor": tensor.clone(), "coords": (dim, lo, hi, tuple(full.shape))}


def test_slices_cut_across_shard_boundaries():
    """Shards saved by TP 2 (rows [0, 3), [3, 6)) give a TP-3 rank rows [2, 4): parts of both."""
    gen = torch.Generator().manual_seed(0)
    w, wo, norm = torch.randn(6, 4, generator=gen), torch.randn(4, 6, generator=gen), torch.randn(6, generator=gen)
    files = [
        {"shards": {"w": _shard(w, 0, 0, 3), "wo": _shard(wo, 1, 0, 3), "norm": _shard(norm, None, 0, 6)}},
        {"shards": {"w": _shard(w, 0, 3, 6), "wo": _shard(wo, 1, 3, 6), "norm": _shard(norm, None, 0, 6)}},
    ]
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
    assert str(e.value) == (
        f"{FOLDER}: --resume: w: part of it is in no rank file (the save is damaged); resume from another step folder"
    )


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
    assert optimizer_steps(opt) == 2
    resumed = [p.detach().clone().requires_grad_() for p in first]
    opt = _adamw(kind, resumed)
    restore_optimizer(opt, {str(i): p for i, p in enumerate(resumed)}, saved, 2)
    assert optimizer_steps(opt) == 2
    steps(opt, resumed, grads[2:])
    for p, q in zip(resumed, whole):
        assert torch.equal(p, q)


FIX = "pass the --checkpoint DIR of an earlier run or one of its step-NNNNNN folders, or start without --resume"


def test_resume_from_a_missing_folder(tmp_path):
    assert_one_error_line(
        invoke_cli(REFERENCE, "--resume", tmp_path / "nope"), f"{tmp_path / 'nope'}: --resume: no such folder ({FIX})"
    )


def test_resume_from_a_folder_without_a_complete_save(tmp_path):
    _save(tmp_path, 2, layout_mod.load(REFERENCE), complete=False)
    assert_one_error_line(
        invoke_cli(REFERENCE, "--resume", tmp_path),
        f"{tmp_path}: --resume: no complete checkpoint here (no step-NNNNNN folder with a "
        f"meta.json; a save interrupted before writing it does not count): {FIX}",
    )
    assert_one_error_line(
        invoke_cli(REFERENCE, "--resume", tmp_path / "step-000002"),
        f"{tmp_path / 'step-000002'}: --resume: an incomplete save (no meta.json: it was "
        "interrupted); pass its parent folder to resume from the newest complete save",
    )


def test_resume_with_a_rank_file_missing(tmp_path):
    folder = _save(tmp_path, 2, layout_mod.load(REFERENCE), world_size=3)
    (folder / "rank1.pt").unlink()
    assert_one_error_line(
        invoke_cli(REFERENCE, "--resume", tmp_path),
        f"{folder}: --resume: rank1.pt is missing (the layout that saved it had 3 ranks); {FIX}",
    )


@pytest.mark.parametrize(
    "overrides,difference",
    [
        (["model.hidden=48"], "embed.tok is [64, 48] in the layout's model but [64, 32] in the checkpoint"),
        (
            ["model.layers=7", "pipelines.0.stages.0.layers=7"],
            "the checkpoint lacks layers.6.attn_norm.weight, layers.6.attn.wq and 7 more",
        ),
        (
            ["model.layers=5", "pipelines.0.stages.0.layers=5"],
            "the layout's model lacks layers.5.attn_norm.weight, layers.5.attn.wq and 7 more",
        ),
    ],
    ids=["other hidden size", "more layers", "fewer layers"],
)
def test_resume_a_checkpoint_of_another_model(overrides, difference, tmp_path):
    folder = _save(tmp_path, 2, layout_mod.load(REFERENCE))
    sets = [a for o in overrides for a in ("--set", o)]
    assert_one_error_line(
        invoke_cli(REFERENCE, *sets, "--resume", tmp_path),
        f"{folder}: --resume: a checkpoint of a different model than {REFERENCE}'s: {difference} "
        "(resume with the [model] it was trained with, or start without --resume)",
    )


def test_resume_with_nothing_left_to_train(tmp_path):
    folder = _save(tmp_path, 3, layout_mod.load(REFERENCE))
    assert_one_error_line(
        invoke_cli(REFERENCE, "--resume", tmp_path),
        f"{folder}: --resume: the checkpoint is at step 3 and train.steps is 3: nothing left to "
        "train (raise it, e.g. --set train.steps=6)",
    )


def test_checkpoint_every_needs_a_folder():
    assert_one_error_line(
        invoke_cli(REFERENCE, "--checkpoint-every", "2"),
        f"{REFERENCE}: --checkpoint-every: needs --checkpoint DIR (the folder to save into)",
    )


DAMAGED = "resume from another step folder (or start without --resume)"


def _save_recorded(root: Path, step: int, contents: list[bytes], layout: Path = REFERENCE) -> Path:
    """A complete save whose meta.json records its rank files (``contents``) and the shards the layout's plan
    gives each rank, as checkpoint.shards.save_checkpoint writes it."""
    from hetero_llm.plan import compile_plan

    lay = layout_mod.load(layout)
    plan = compile_plan(lay)
    folder = folders.step_folder(root, step)
    folders.begin_save(folder)
    for r, data in enumerate(contents):
        folders.rank_file(folder, r).write_bytes(data)
    digests = [folders.file_digest(folders.rank_file(folder, r)) for r in range(len(contents))]
    folders.finish_save(
        folder, step, plan.world_size, lay, folders.file_records(plan.rank_plan(0).saved_shards, digests)
    )
    return folder


def test_meta_records_size_sha256_and_shards_of_every_rank_file(tmp_path):
    import hashlib
    import json

    folder = _save_recorded(tmp_path, 2, [b"rank zero's bytes"])
    meta = json.loads((folder / "meta.json").read_text())
    record = meta["files"]["rank0.pt"]
    assert record["bytes"] == 17 and record["sha256"] == hashlib.sha256(b"rank zero's bytes").hexdigest()
    assert record["shards"]["layers.0.attn.wq"] == {"dim": 0, "range": [0, 32], "shape": [32, 32]}
    assert record["shards"]["layers.0.attn.wo"] == {"dim": 1, "range": [0, 32], "shape": [32, 32]}
    assert set(record["shards"]) == set(meta["params"])
    assert '  "layers.0.attn.wq": [32, 32],\n' in (folder / "meta.json").read_text()  # one line per tensor
    found = folders.find(tmp_path)
    assert found.files["rank0.pt"].shards["layers.0.attn.wq"] == (0, 0, 32, (32, 32))
    assert folders.verify(found) is None


@pytest.mark.parametrize(
    "damage,problem",
    [
        (
            lambda data: data[:5] + bytes([data[5] ^ 1]) + data[6:],  # one bit flipped
            "its sha256 is not the one meta.json recorded when it was saved (the file changed since: damaged, edited, "
            "or copied from another save)",
        ),
        (lambda data: data[:-4], "12 bytes, but 16 were saved (truncated or replaced since)"),
        (lambda data: b"", "0 bytes, but 16 were saved (truncated or replaced since)"),
        (lambda data: b"another model's rank file", "25 bytes, but 16 were saved (truncated or replaced since)"),
    ],
    ids=["bit flip", "truncated", "zero bytes", "another save's file"],
)
def test_a_damaged_rank_file_is_refused_before_any_rank_starts(damage, problem, tmp_path):
    folder = _save_recorded(tmp_path, 2, [b"0123456789abcdef"])
    path = folder / "rank0.pt"
    path.write_bytes(damage(path.read_bytes()))
    assert_one_error_line(
        invoke_cli(REFERENCE, "--set", "train.steps=4", "--resume", tmp_path), f"{path}: --resume: {problem}; {DAMAGED}"
    )


def test_rank_files_swapped_between_ranks_are_refused(tmp_path):
    """Two files of one save, each intact but under the other's name (say, copied from another layout's save)."""
    contents = [f"rank {r}".encode() for r in range(6)]  # three_pipelines.toml has 6 ranks
    folder = _save_recorded(tmp_path, 2, contents, LAYOUTS / "examples" / "three_pipelines.toml")
    one, two = folder / "rank1.pt", folder / "rank2.pt"
    a, b = one.read_bytes(), two.read_bytes()
    one.write_bytes(b)
    two.write_bytes(a)
    result = invoke_cli(
        LAYOUTS / "examples" / "three_pipelines.toml", "--set", "train.steps=4", "--resume", folder, "--dry-run"
    )
    assert_one_error_line(
        result,
        f"{one}: --resume: its sha256 is not the one meta.json recorded when it was saved "
        f"(the file changed since: damaged, edited, or copied from another save); {DAMAGED}",
    )


def test_shards_that_miss_part_of_a_tensor_are_refused(tmp_path):
    """A save whose ranks did not hold every layer (the bug class of issue 10 §1) is refused before any rank starts."""
    import json

    folder = _save_recorded(tmp_path, 2, [b"x"])
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"]["rank0.pt"]["shards"]["layers.0.mlp.w1"]["range"] = [0, 64]
    (folder / "meta.json").write_text(json.dumps(meta))
    assert_one_error_line(
        invoke_cli(REFERENCE, "--set", "train.steps=4", "--resume", tmp_path),
        f"{folder}: --resume: layers.0.mlp.w1 from row 64 of dim 0 is in no rank file: the save is "
        f"incomplete; {DAMAGED}",
    )
    del meta["files"]["rank0.pt"]["shards"]["layers.0.mlp.w1"]
    meta["files"]["rank0.pt"]["shards"]["layers.9.mlp.w1"] = {"dim": 0, "range": [0, 64], "shape": [64, 32]}
    (folder / "meta.json").write_text(json.dumps(meta))
    assert_one_error_line(
        invoke_cli(REFERENCE, "--set", "train.steps=4", "--resume", tmp_path),
        f"{folder}: --resume: meta.json is not a hetero_llm checkpoint's (KeyError: 'layers.9.mlp.w1'); {FIX}",
    )


@pytest.mark.parametrize("text", ["../elsewhere/step-000002", "/tmp/step-000002", "step-000002/..", "meta.json"])
def test_latest_never_leads_outside_the_checkpoint_folder(text, tmp_path):
    root = tmp_path / "ckpt"
    _save_recorded(root, 2, [b"x"])
    _save_recorded(tmp_path / "elsewhere", 2, [b"y"])
    (root / "latest").write_text(text + "\n")
    assert_one_error_line(
        invoke_cli(REFERENCE, "--set", "train.steps=4", "--resume", root),
        f"{root / 'latest'}: --resume: names {text!r}, not a step-NNNNNN folder of {root} (write "
        "the name of one of its step folders into it, or delete it to resume from the "
        "highest-numbered complete one)",
    )


def test_latest_through_a_symlink_out_of_the_folder_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    outside = _save_recorded(tmp_path / "elsewhere", 2, [b"y"])
    (root / "step-000002").symlink_to(outside)
    (root / "latest").write_text("step-000002\n")
    result = invoke_cli(REFERENCE, "--set", "train.steps=4", "--resume", root)
    assert result.exit_code == 2 and "names 'step-000002', not a step-NNNNNN folder of" in result.stderr


def test_a_save_without_records_resumes_with_a_warning(tmp_path):
    """Saves from before meta.json recorded its files are accepted, unverified, with one warning line."""
    folder = _save(tmp_path, 2, layout_mod.load(REFERENCE))
    result = invoke_cli(REFERENCE, "--set", "train.steps=4", "--resume", tmp_path, "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == (
        f"warning: {folder}: --resume: meta.json records no sizes or checksums of its rank "
        "files (a save by an earlier hetero_llm): resuming without verifying them\n"
    )


def test_a_rank_names_an_unreadable_rank_file_of_an_unrecorded_save(tmp_path):
    """Without records nothing is checked before the ranks start; the rank that reads the file names it."""
    from hetero_llm.checkpoint.shards import _load_rank_file

    folder = _save(tmp_path, 2, layout_mod.load(REFERENCE))  # its rank0.pt is empty
    with pytest.raises(CheckpointError) as e:
        _load_rank_file(folders.find(tmp_path), 0)
    assert str(e.value).startswith(f"{folder / 'rank0.pt'}: --resume: cannot be read (")  # then torch's words
    assert str(e.value).endswith(f"): the save is damaged; {DAMAGED}")


def test_a_rank_refuses_shards_of_another_models_shape(tmp_path):
    from hetero_llm.checkpoint.shards import _load_rank_file

    folder = _save(tmp_path, 2, layout_mod.load(REFERENCE))
    wq = torch.zeros(48, 32)
    torch.save(
        {
            "shards": {
                "layers.0.attn.wq": {"tensor": wq, "exp_avg": wq, "exp_avg_sq": wq, "coords": (0, 0, 48, (48, 32))}
            }
        },
        folder / "rank0.pt",
    )
    with pytest.raises(CheckpointError) as e:
        _load_rank_file(folders.find(tmp_path), 0)
    assert str(e.value) == (
        f"{folder / 'rank0.pt'}: --resume: its shard of layers.0.attn.wq ([32, 32]) is rows "
        f"[0, 48) of dim 0, outside the tensor: the save is damaged; {DAMAGED}"
    )


def test_the_next_save_removes_temporary_files_of_a_killed_one(tmp_path):
    lay = layout_mod.load(REFERENCE)
    killed = folders.step_folder(tmp_path, 2)
    killed.mkdir(parents=True)
    leftovers = [killed / "rank0.pt.tmp", killed / "meta.json.tmp", tmp_path / "latest.tmp"]
    for path in leftovers:
        path.write_bytes(b"half")
    (killed / "rank1.pt").write_bytes(b"complete rank file of the killed save")
    _save(tmp_path, 4, lay)
    assert not [p for p in leftovers if p.exists()]
    assert (killed / "rank1.pt").exists()  # only temporary files go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000002", "step-000004"]


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    def fail(f):
        f.write(b"half")
        raise OSError("No space left on device")

    with pytest.raises(OSError):
        folders.write_atomically(tmp_path / "rank0.pt", fail)
    assert list(tmp_path.iterdir()) == []
