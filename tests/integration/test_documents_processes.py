"""The tests of tests/unit/test_documents.py that start processes or train for real (the integration tier).

Whole documents: sources, a step's documents, packing, and document masks in the model.

The contract checked last: a token's loss is the same however its documents were packed, and equals
the loss of its document run alone, unpacked (per-document attention, positions restarting).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harness import LAYOUTS, assert_same_model, common_sections, launch, write_layout
from hetero_llm import layout as layout_mod
from hetero_llm.data import held_out, sources
from hetero_llm.data.documents import fill_rows
from hetero_llm.data.sources import make_document_source
from hetero_llm.model.forward import StageShape, stage_forward

PACKED = common_sections(LAYOUTS / "reference" / "reference.toml").replace(
    'kind = "grammar"', 'kind = "grammar"\npacking = "documents"\ndoc_len_median = 8.0\ndoc_len_sigma = 0.5'
)


@pytest.mark.multiprocess
def test_packed_documents_train_the_same_model_under_a_tp_and_pipeline_layout(tmp_path):
    """2 pipelines (2 stages with TP 2 | 1 stage) against one process, both on packed documents."""
    assert 'packing = "documents"' in PACKED
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    evaluating = ("--set", "train.eval_every=2", "--set", "train.eval_batches=2")  # after steps 2 and 3
    ref = launch(
        write_layout(tmp_path / "ref" / "ref.toml", PACKED, [(12, 3, [(6, 1)])]), tmp_path / "ref", *evaluating
    )
    run = launch(
        write_layout(tmp_path / "run" / "run.toml", PACKED, [(8, 4, [(2, 1), (4, 2)]), (4, 2, [(6, 1)])]),
        tmp_path / "run",
        *evaluating,
    )
    assert_same_model(run, ref)
    # Held-out loss over packed held-out documents: the same under both layouts ...
    valid = {
        k: [json.loads(line).get("valid_loss") for line in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
        for k in ("ref", "run")
    }
    assert valid["ref"][0] is None and None not in valid["ref"][1:]
    for a, b in zip(valid["run"], valid["ref"]):
        assert (a is None and b is None) or abs(a - b) <= 1e-5 * b, valid
    # ... and, at the end, the final model's mean loss over those documents' targets, each document run alone
    lay = layout_mod.load(tmp_path / "ref" / "ref.toml")
    _, held_out_source = sources.document_sources(lay.data, lay.model.seq_len, lay.file)
    total, targets = 0.0, 0
    with torch.no_grad():
        for index in range(2):
            rows = held_out.held_out_rows(held_out_source, lay.train.seed, index, 12, 16)
            assert rows.num_targets > 0
            for r, start, n in rows.spans.tolist():
                doc = np.concatenate([rows.inputs[r, start : start + n], rows.targets[r, start + n - 1 : start + n]])
                logits = stage_forward(
                    ref.params, torch.from_numpy(doc[None, :-1]), StageShape(0, lay.model.layers, True, True), lay.model
                )
                total += float(F.cross_entropy(logits[0], torch.from_numpy(doc[1:]), reduction="sum"))
                targets += n
    assert abs(total / targets - valid["ref"][-1]) <= 1e-5 * valid["ref"][-1]
    # The loss averages over the documents' targets, which leave some of the 12 x 16 positions as padding.
    lay = layout_mod.load(tmp_path / "run" / "run.toml")
    source = make_document_source(lay.data, lay.model.seq_len, lay.file)
    want = [fill_rows(source, lay.train.seed, step, 12, 16).num_targets for step in range(3)]
    tokens = [json.loads(line)["tokens"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert tokens == want and all(0.8 * 192 < t < 192 for t in tokens), tokens
