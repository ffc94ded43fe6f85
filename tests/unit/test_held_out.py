"""Held-out evaluation: the same held-out batches under every layout, the loss a one-process model gives on
them, printed next to the training loss and written to the metrics JSONL with the console's step numbers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from harness import LAYOUTS, RTOL, common_sections, free_port, launch, write_layout
from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint.shards import load_full_params
from hetero_llm.data import held_out
from hetero_llm.errors import LayoutError
from hetero_llm.model.forward import StageShape, stage_forward, token_loss_sum

COMMON = common_sections(LAYOUTS / "reference" / "reference.toml").replace(
    "log_every = 1", "log_every = 1\neval_every = 2\neval_batches = 2"
)


def run_console(layout, workdir, *extra):
    """hetero-launch without --quiet: the console lines and the metrics rows."""
    metrics, ckpt = workdir / "metrics.jsonl", workdir / "ckpt"
    cmd = [
        sys.executable,
        "-m",
        "hetero_llm.cli",
        str(layout),
        "--metrics-jsonl",
        str(metrics),
        "--checkpoint",
        str(ckpt),
        "--set",
        f"cluster.port={free_port()}",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.mark.multiprocess
def test_held_out_loss_is_the_same_under_every_layout(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    one = write_layout(tmp_path / "one" / "layout.toml", COMMON, [(12, 3, [(6, 1)])])
    tensorboard = importlib.util.find_spec("tensorboard") is not None  # the 'tensorboard' extra
    stdout, rows = run_console(one, tmp_path / "one", *(["--tensorboard", str(tmp_path / "tb")] if tensorboard else []))
    # console and JSONL count steps alike, from 1; the evaluating steps carry valid_loss
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [("valid_loss" in r) for r in rows] == [False, True, True]
    for r in rows:
        line = next(x for x in stdout.splitlines() if x.startswith(f"step {r['step']:>5}/3 | loss {r['loss']:.4f}"))
        assert ("| valid " in line) == ("valid_loss" in r)
        if "valid_loss" in r:
            assert f"| valid {r['valid_loss']:.4f} |" in line

    if tensorboard:  # the same numbers at the same steps as TensorBoard scalars
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        assert [(e.step, round(e.value, 5)) for e in events.Scalars("train/loss")] == [
            (r["step"], round(r["loss"], 5)) for r in rows
        ]
        assert [e.step for e in events.Scalars("train/valid_loss")] == [2, 3]

    zero1 = COMMON.replace('schedule = "1f1b"', 'schedule = "1f1b"\noptimizer = "adamw_zero1"')  # AG before evaluating
    many = launch(
        write_layout(
            tmp_path / "many" / "layout.toml",
            zero1,
            [(8, 4, [(2, 1), (3, 2), (1, 1)]), (4, 2, [(4, 2), (2, 2)])],
            "zbh1",
        ),
        tmp_path / "many",
    )
    many_rows = [json.loads(line) for line in (tmp_path / "many" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(many_rows, rows):
        assert a.keys() == b.keys()
        if "valid_loss" in b:
            assert abs(a["valid_loss"] - b["valid_loss"]) <= RTOL * b["valid_loss"]

    # the logged loss is the final model's mean loss over exactly held-out batches 0 and 1
    lay = layout_mod.load(one)
    params = load_full_params(str(tmp_path / "one" / "ckpt"))
    train, valid = held_out.train_and_held_out(lay.data, lay.file)
    total = 0.0
    with torch.no_grad():
        for index in range(2):
            batch = torch.from_numpy(held_out.batch(valid, lay.train.seed, index, 12, lay.model.seq_len))
            logits = stage_forward(params, batch[:, :-1], StageShape(0, 6, True, True), lay.model)
            total += float(token_loss_sum(logits, batch[:, 1:]))
    assert abs(total / (2 * 12 * 16) - rows[-1]["valid_loss"]) <= RTOL * rows[-1]["valid_loss"]
    assert many.losses  # trained


def test_held_out_batches_differ_from_training_batches():
    lay = layout_mod.loads(
        COMMON + '[cluster]\n[[cluster.nodes]]\nname = "n"\n[[pipelines]]\nbatch = 12\n'
        'microbatches = 1\n[[pipelines.stages]]\nlayers = 6\ndevices = ["n:0"]\n'
    )
    train, valid = held_out.train_and_held_out(lay.data, lay.file)
    from hetero_llm.data import batches

    held = held_out.batch(valid, 7, 0, 12, 16)
    assert np.array_equal(held, held_out.batch(valid, 7, 0, 12, 16))
    assert not any(np.array_equal(held, batches.global_batch(train, 7, step, 12, 16)) for step in range(5))


def test_valid_fraction_holds_out_the_end_of_the_file(tmp_path):
    (tmp_path / "t.txt").write_bytes(bytes(range(32, 127)) * 20)
    text = (
        COMMON.replace("vocab = 64", "vocab = 256").replace(
            'kind = "grammar"', 'kind = "text"\npath = "t.txt"\nvalid_fraction = 0.25'
        )
        + '[cluster]\n[[cluster.nodes]]\nname = "n"\n[[pipelines]]\nbatch = 12\nmicrobatches = 1\n'
        '[[pipelines.stages]]\nlayers = 6\ndevices = ["n:0"]\n'
    )
    lay = layout_mod.loads(text, base_dir=tmp_path)
    train, valid = held_out.train_and_held_out(lay.data, lay.file)
    n = 95 * 20
    assert len(train.tokens) == n * 3 // 4 and len(valid.tokens) == n - n * 3 // 4
    assert np.array_equal(
        np.concatenate([train.tokens, valid.tokens]), np.frombuffer(bytes(range(32, 127)) * 20, np.uint8)
    )


def _packed(tmp_path, data: str):
    text = (
        COMMON.replace("vocab = 64", "vocab = 256").replace('kind = "grammar"', data + '\npacking = "documents"')
        + '[cluster]\n[[cluster.nodes]]\nname = "n"\n[[pipelines]]\nbatch = 12\nmicrobatches = 1\n'
        '[[pipelines.stages]]\nlayers = 6\ndevices = ["n:0"]\n'
    )
    return layout_mod.loads(text, base_dir=tmp_path)


def test_held_out_documents_are_packed_on_a_stream_of_their_own_and_never_trained(tmp_path):
    from hetero_llm.data import documents

    docs = [f"d{i} " + "x" * (i % 7) for i in range(40)]  # shorter than seq_len: one piece each
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    lay = _packed(tmp_path, 'kind = "jsonl"\npath = "d.jsonl"\nvalid_fraction = 0.25')
    train, valid = held_out.document_sources(lay.data, lay.model.seq_len, lay.file)
    assert (train.num_documents, valid.num_documents) == (30, 10)  # the last quarter of the documents, in file order
    assert train.starts.max() < valid.starts.min()

    def texts(rows):
        return {bytes(rows.inputs[r, s : s + n].astype(np.uint8)) for r, s, n in rows.spans.tolist()}

    held = held_out.held_out_rows(valid, 7, 0, 12, 16)
    assert held.num_targets > 0
    assert np.array_equal(held.inputs, held_out.held_out_rows(valid, 7, 0, 12, 16).inputs)  # a pure function
    assert not np.array_equal(held.inputs, held_out.held_out_rows(valid, 7, 1, 12, 16).inputs)
    trained = set().union(*(texts(documents.fill_rows(train, 7, step, 12, 16)) for step in range(20)))
    assert texts(held) and not texts(held) & trained  # no held-out document is ever a training one
    # the grammar: held-out rows are other samples than every training step's
    lay = _packed(tmp_path, 'kind = "grammar"')
    train, valid = held_out.document_sources(lay.data, lay.model.seq_len, lay.file)
    held = held_out.held_out_rows(valid, 7, 0, 12, 16)
    assert not any(np.array_equal(held.inputs, documents.fill_rows(train, 7, step, 12, 16).inputs) for step in range(5))


def test_valid_fraction_of_a_one_document_file_is_one_line(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "only one"}) + "\n")
    lay = _packed(tmp_path, 'kind = "jsonl"\npath = "d.jsonl"\nvalid_fraction = 0.1')
    with pytest.raises(LayoutError, match=r"data.valid_fraction: .*has 1 document: nothing to hold out \(give a file"):
        held_out.document_sources(lay.data, lay.model.seq_len, lay.file)


def test_tensorboard_flag_without_tensorboard_is_one_line(tmp_path, monkeypatch):
    from harness import assert_one_error_line, invoke_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    layout = write_layout(tmp_path / "layout.toml", COMMON, [(12, 3, [(6, 1)])])
    assert_one_error_line(
        invoke_cli(layout, "--tensorboard", tmp_path / "tb"),
        f"{layout}: --tensorboard: needs the tensorboard package (pip install tensorboard)",
    )
