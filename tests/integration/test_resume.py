"""Layout invariance across a resume: layout A saves after step 2 of 4, layout B resumes from that save for
steps 2 and 3, and together they train what one process trains in 4 steps (losses, grad norms and final
parameters, to the tolerances of tests/integration/test_invariance.py).

The reference run is also the saved run the folder tests look at: ``--checkpoint-every 2`` of 4 steps.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import attrs
import pytest
import torch

from harness import (
    LAYOUTS,
    RunResult,
    assert_one_error_line,
    assert_same_model,
    common_sections,
    free_port,
    invoke_cli,
    launch,
    write_layout,
)
from hetero_llm.checkpoint import folders
from hetero_llm.checkpoint.shards import load_full_params

pytestmark = pytest.mark.multiprocess

REFERENCE = LAYOUTS / "reference" / "reference.toml"
COMMON = common_sections(REFERENCE)  # 6 layers, hidden 32, 4 heads, global batch 12
STEPS = ("--set", "train.steps=4")  # the learning rate schedule depends on train.steps: same in every run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return launch(REFERENCE, tmp_path_factory.mktemp("reference"), *STEPS, "--checkpoint-every", "2")


def test_checkpoint_every_saves_step_folders_and_points_latest_at_the_last(reference):
    root = reference.workdir / "ckpt"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002", "step-000004"]
    assert (root / "latest").read_text() == "step-000004\n"
    for step in (2, 4):
        folder = folders.step_folder(root, step)
        assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "rank0.pt"]  # no temporary file left
        assert json.loads((folder / "meta.json").read_text())["step"] == step
    last = load_full_params(str(root / "step-000004"))
    assert all(t.equal(reference.params[n]) for n, t in last.items())  # the root means its latest save
    earlier = load_full_params(str(root / "step-000002"))
    assert not earlier["lm_head.weight"].equal(last["lm_head.weight"])


# (name, layout A [(batch, microbatches, [(layers, tp), ...])], schedule A, layout B (None: one process), schedule B)
CASES = [
    (
        "2 stages 1f1b -> 2 pipelines with tp [[1, 2], [1]]",
        [(12, 4, [(4, 1), (2, 1)])],
        "1f1b",
        [(8, 4, [(3, 1), (3, 2)]), (4, 2, [(6, 1)])],
        "1f1b",
    ),
    (
        "2 pipelines with tp [[1, 2, 1], [2, 2]] -> one process",
        [(8, 4, [(1, 1), (3, 2), (2, 1)]), (4, 2, [(4, 2), (2, 2)])],
        "1f1b",
        None,
        None,
    ),
    ("one process -> 3 stages tp [1, 4, 2], gpipe", None, None, [(12, 3, [(2, 1), (2, 4), (2, 2)])], "gpipe"),
]


@pytest.mark.parametrize("name,a,schedule_a,b,schedule_b", CASES, ids=[c[0] for c in CASES])
def test_resumed_on_another_layout_trains_the_reference_model(name, a, schedule_a, b, schedule_b, reference, tmp_path):
    path_a = write_layout(tmp_path / "a.toml", COMMON, a, schedule_a) if a else REFERENCE
    path_b = write_layout(tmp_path / "b.toml", COMMON, b, schedule_b) if b else REFERENCE
    first = launch(path_a, tmp_path / "a", *STEPS, "--checkpoint-every", "2")
    rest = launch(path_b, tmp_path / "b", *STEPS, "--resume", str(tmp_path / "a" / "ckpt" / "step-000002"))
    assert len(rest.losses) == 2  # steps 2 and 3 only
    both = attrs.evolve(rest, losses=first.losses[:2] + rest.losses, grad_norms=first.grad_norms[:2] + rest.grad_norms)
    assert_same_model(both, reference)


def test_resume_skips_an_interrupted_save_and_keeps_the_metrics_before_it(reference, tmp_path):
    """A crash while saving step 4: its folder has no meta.json. ``--resume DIR`` takes step 2, trains
    steps 2 and 3 again, saves step 4 again; the metrics file keeps steps 0 and 1 and gets 2 and 3 anew."""
    root, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    shutil.copytree(reference.workdir / "ckpt", root)
    shutil.copy(reference.workdir / "metrics.jsonl", metrics)
    (root / "step-000004" / "meta.json").unlink()
    cmd = [
        sys.executable,
        "-m",
        "hetero_llm.cli",
        str(REFERENCE),
        *STEPS,
        "--resume",
        str(root),
        "--checkpoint",
        str(root),
        "--metrics-jsonl",
        str(metrics),
        "--set",
        f"cluster.port={free_port()}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("resuming from") == 1
    assert f"resuming from {root / 'step-000002'} (step 2 of 4)\n" in proc.stdout
    assert (root / "latest").read_text() == "step-000004\n"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # steps taken, as the console and step folders count them
    resumed = RunResult(
        [r["loss"] for r in rows], [r["grad_norm"] for r in rows], load_full_params(str(root)), proc.stdout, proc.stderr
    )
    assert_same_model(resumed, reference)


# ------------------------------------------------------------------------------------ integrity of real saves


def test_a_save_records_the_size_and_sha256_of_each_rank_file(reference):
    import hashlib

    for step in (2, 4):
        folder = folders.step_folder(reference.workdir / "ckpt", step)
        record = json.loads((folder / "meta.json").read_text())["files"]["rank0.pt"]
        data = (folder / "rank0.pt").read_bytes()
        assert (record["bytes"], record["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
        assert folders.verify(folders.find(folder)) is None


def _nan_filled(path):
    """NaN over one tensor's values in place: the file keeps its size and its structure."""
    values = torch.load(path, weights_only=True)["shards"]["layers.2.mlp.w1"]["tensor"].numpy().tobytes()
    data = path.read_bytes()
    assert data.count(values) == 1
    path.write_bytes(data.replace(values, torch.full((len(values) // 4,), float("nan")).numpy().tobytes()))


def _bit_flipped(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_bit_flipped, _nan_filled], ids=["bit flip", "NaN-filled"])
def test_a_damaged_rank_file_of_a_real_save_is_refused(damage, reference, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(reference.workdir / "ckpt", root)
    damage(root / "step-000002" / "rank0.pt")
    assert_one_error_line(
        invoke_cli(REFERENCE, *STEPS, "--resume", root / "step-000002"),
        f"{root / 'step-000002' / 'rank0.pt'}: --resume: its sha256 is not the one meta.json recorded "
        "when it was saved (the file changed since: damaged, edited, or copied from another save); "
        "resume from another step folder (or start without --resume)",
    )


def test_a_nan_filled_save_without_records_is_refused_by_the_ranks(reference, tmp_path):
    """A save from before meta.json's records is resumed unverified (one warning line); its NaN values still
    stop the run before it trains, naming the tensor."""
    root = tmp_path / "ckpt"
    shutil.copytree(reference.workdir / "ckpt", root)
    folder = root / "step-000002"
    meta = json.loads((folder / "meta.json").read_text())
    del meta["files"]
    (folder / "meta.json").write_text(json.dumps(meta))
    _nan_filled(folder / "rank0.pt")
    cmd = [
        sys.executable,
        "-m",
        "hetero_llm.cli",
        str(REFERENCE),
        *STEPS,
        "--quiet",
        "--resume",
        str(folder),
        "--set",
        f"cluster.port={free_port()}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == (
        f"warning: {folder}: --resume: meta.json records no sizes or checksums of its rank files (a "
        "save by an earlier hetero_llm): resuming without verifying them"
    )
    assert len(lines) == 2 and lines[1].startswith(
        "error: rank 0 (node0:0, pipeline 0 stage 0) failed: "
        f"{folder}: --resume: the tensor of layers.2.mlp.w1 holds NaN or "
        "infinite values; resume from another step folder"
    ), proc.stderr
