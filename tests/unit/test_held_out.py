"""Held-out evaluation: the same held-out batches under every layout, the loss a one-process model gives on
them, printed next to the training loss and written to the metrics JSONL with the console's step numbers."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from harness import LAYOUTS, common_sections, write_layout
from hetero_llm import layout as layout_mod
from hetero_llm.data import batches, held_out, sources
from hetero_llm.errors import LayoutError

COMMON = common_sections(LAYOUTS / "reference" / "reference.toml").replace(
    "log_every = 1", "log_every = 1\neval_every = 2\neval_batches = 2"
)


def test_held_out_batches_differ_from_training_batches():
    lay = layout_mod.loads(
        COMMON + '[cluster]\n[[cluster.nodes]]\nname = "n"\n[[pipelines]]\nbatch = 12\n'
        'microbatches = 1\n[[pipelines.stages]]\nlayers = 6\ndevices = ["n:0"]\n'
    )
    train, valid = sources.train_and_held_out(lay.data, lay.file)

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
    train, valid = sources.train_and_held_out(lay.data, lay.file)
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
    train, valid = sources.document_sources(lay.data, lay.model.seq_len, lay.file)
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
    train, valid = sources.document_sources(lay.data, lay.model.seq_len, lay.file)
    held = held_out.held_out_rows(valid, 7, 0, 12, 16)
    assert not any(np.array_equal(held.inputs, documents.fill_rows(train, 7, step, 12, 16).inputs) for step in range(5))


def test_valid_fraction_of_a_one_document_file_is_one_line(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "only one"}) + "\n")
    lay = _packed(tmp_path, 'kind = "jsonl"\npath = "d.jsonl"\nvalid_fraction = 0.1')
    with pytest.raises(LayoutError, match=r"data.valid_fraction: .*has 1 document: nothing to hold out \(give a file"):
        sources.document_sources(lay.data, lay.model.seq_len, lay.file)


def test_tensorboard_flag_without_tensorboard_is_one_line(tmp_path, monkeypatch):
    from harness import assert_one_error_line, invoke_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    layout = write_layout(tmp_path / "layout.toml", COMMON, [(12, 3, [(6, 1)])])
    assert_one_error_line(
        invoke_cli(layout, "--tensorboard", tmp_path / "tb"),
        f"{layout}: --tensorboard: needs the tensorboard package (pip install tensorboard)",
    )
