"""Whole documents: sources, a step's documents, packing, and document masks in the model.

The contract checked last: a token's loss is the same however its documents were packed, and equals
the loss of its document run alone, unpacked (per-document attention, positions restarting).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harness import LAYOUTS, assert_one_error_line, invoke_cli
from hetero_llm.data.batches import GrammarSource
from hetero_llm.data.documents import (
    IGNORE,
    FileDocuments,
    GrammarDocuments,
    fill_rows,
    first_fit_decreasing,
    pack,
    pack_placed,
    step_documents,
)
from hetero_llm.data.sources import SourceSpec, make_source
from hetero_llm.errors import LayoutError
from hetero_llm.layout import Mlp, ModelSpec, Norm, Position
from hetero_llm.model.document_mask import DocumentMask, ladder_length
from hetero_llm.model.forward import StageShape, init_full, stage_forward
from hetero_llm.model.params import all_params

LAYOUT = "layout.toml"


@pytest.fixture(scope="module")
def grammar() -> GrammarSource:
    spec = SourceSpec(kind="grammar", grammar_seed=1234, grammar_vocab=32, branching=4)
    return make_source(spec, LAYOUT)


@pytest.fixture(scope="module")
def docs_source(grammar) -> GrammarDocuments:
    return GrammarDocuments(grammar, median=12, sigma=1.0, max_tokens=65)


def test_lengths_are_long_tailed_and_bounded(docs_source):
    assert docs_source.pmf.sum() == pytest.approx(1.0)
    _, lengths = docs_source.candidates(np.random.default_rng(0), 20_000)
    assert lengths.min() >= 2 and lengths.max() <= 65
    assert np.median(lengths) == pytest.approx(12, abs=1)
    assert (lengths > 48).mean() > 0.02  # a tail, clipped at the longest document
    assert (lengths == 65).mean() == pytest.approx(docs_source.pmf[-1], abs=0.01)


def test_document_loss_floor_matches_the_true_model(docs_source, grammar):
    """The floor is the cross-entropy of the generating distribution on its documents."""
    rng = np.random.default_rng(3)
    ids, lengths = docs_source.candidates(rng, 3000)
    docs = docs_source.documents(rng, ids, lengths)
    probs, pairs = grammar.transition_matrix(), grammar.stationary_pairs
    total = 0.0
    for d in docs:
        total -= np.log(pairs[d[0], d[1]] / pairs.sum(axis=1)[d[0]])
        total -= np.log(probs[d[:-2], d[1:-1], d[2:]]).sum()
    empirical = total / (lengths - 1).sum()
    assert empirical == pytest.approx(docs_source.batch_loss_floor(lengths), rel=0.02)
    # Short documents have more first targets (predicted from one token): the floor sits above the rate.
    assert grammar.entropy_rate() < docs_source.expected_loss_floor() < grammar.first_target_entropy()
    assert docs_source.batch_loss_floor(lengths) == pytest.approx(docs_source.expected_loss_floor(), rel=0.02)


def test_jsonl_documents_are_lines(tmp_path):
    path = tmp_path / "docs.jsonl"
    texts = ["hello", "a", "", "wide world", "x" * 30]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    source = FileDocuments.from_file(str(path), "jsonl", "text", "\n\n", max_tokens=12)
    got = source.documents(None, np.arange(source.num_documents), source.lengths)
    # "a" and "" have fewer than 2 tokens; the 30-byte document is cut into 12 + 12 + 6.
    assert [bytes(d.astype(np.uint8)) for d in got] == [b"hello", b"wide world", b"x" * 12, b"x" * 12, b"x" * 6]


def test_text_is_split_on_the_separator(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"one doc\n\n\ntwo docs\n\nthree\n\n")
    source = FileDocuments.from_file(str(path), "text", "text", "\n\n", max_tokens=100)
    got = [bytes(d.astype(np.uint8)) for d in source.documents(None, np.arange(source.num_documents), source.lengths)]
    assert got == [b"one doc", b"\ntwo docs", b"three"]  # a run of three newlines: one separator and a newline
    whole = FileDocuments.from_file(str(path), "text", "text", "", max_tokens=100)
    assert whole.num_documents == 1 and whole.lengths[0] == len(path.read_bytes())


def test_file_without_documents_names_the_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n")
    with pytest.raises(LayoutError) as info:
        FileDocuments.from_file(str(path), "jsonl", "text", "\n\n", max_tokens=16, file_for_errors=LAYOUT)
    assert str(info.value) == (
        f"{LAYOUT}: data.path: file '{path}' has no document of 2 or more tokens "
        "(give a file with text between its separators)"
    )


def test_step_documents_are_a_pure_function_of_seed_and_step(docs_source):
    a = step_documents(docs_source, 7, 3, documents=20)
    b = step_documents(docs_source, 7, 3, documents=20)
    c = step_documents(docs_source, 7, 4, documents=20)
    assert len(a) == 20 and all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(len(x) == len(y) and np.array_equal(x, y) for x, y in zip(a, c))


def test_token_budget_is_filled_without_exceeding_it(docs_source):
    docs = step_documents(docs_source, 1, 0, tokens=500)
    targets = sum(len(d) - 1 for d in docs)
    assert targets <= 500 and targets > 500 - 64
    assert [len(d) for d in docs] == [len(d) for d in step_documents(docs_source, 1, 0, tokens=500)]
    with pytest.raises(ValueError, match="exactly one"):
        step_documents(docs_source, 1, 0, documents=3, tokens=10)


def test_fill_rows_packs_whole_documents_into_fixed_rows(docs_source):
    rows = fill_rows(docs_source, 5, 2, rows=4, width=64)
    assert rows.inputs.shape == (4, 64) and rows.num_rows == 4
    again = fill_rows(docs_source, 5, 2, rows=4, width=64)
    assert np.array_equal(rows.inputs, again.inputs) and np.array_equal(rows.spans, again.spans)
    real = rows.targets != IGNORE
    assert rows.num_targets == real.sum() > 0.9 * rows.targets.size  # the rows are nearly full
    for r, start, n in rows.spans.tolist():
        assert np.array_equal(rows.positions[r, start : start + n], np.arange(n))
        # inputs and targets are one document shifted by one
        assert np.array_equal(rows.inputs[r, start + 1 : start + n], rows.targets[r, start : start + n - 1])


def test_first_fit_decreasing_and_row_limits():
    lengths = [9, 3, 5, 7, 2]  # targets 8, 2, 4, 6, 1 into rows of 10
    rows_of = first_fit_decreasing(lengths, 10)
    # longest first: 8 -> row 0, 6 -> row 1, 4 -> row 1 (row 0 has 2 left), 2 -> row 0, 1 -> a new row
    assert rows_of == [0, 0, 1, 1, 2]
    packed = pack([np.arange(n) for n in lengths], 10)
    assert packed.num_rows == 3 and packed.num_targets == 21
    with pytest.raises(ValueError, match="need 3 rows of 10 positions, more than 1"):
        pack([np.arange(n) for n in lengths], 10, rows=1)
    with pytest.raises(ValueError, match="does not fit a row of 10 positions"):
        first_fit_decreasing([12], 10)
    share = pack([np.arange(n) for n in lengths], 10, rows=4).share(2, 2, 2)
    assert [p.num_rows for p in share] == [1, 1]
    assert share[0].spans.tolist() == [[0, 0, 1]] and share[1].spans.size == 0  # renumbered from row 0; padding


def test_ladder_lengths():
    assert [ladder_length(n) for n in (1, 8, 9, 12, 13, 17, 100, 129)] == [8, 8, 12, 12, 16, 24, 128, 192]


MODELS = {
    "gpt": ModelSpec(layers=2, hidden=32, heads=4, vocab=32, seq_len=40),
    "llama": ModelSpec(
        layers=2, hidden=32, heads=4, vocab=32, seq_len=40, norm=Norm.RMSNORM, position=Position.ROPE, mlp=Mlp.SWIGLU
    ),
}


def _token_losses(model: ModelSpec, params: dict, packed) -> dict[tuple[int, int], torch.Tensor]:
    """Loss of every target of ``packed``, keyed by (document, position); documents in span order."""
    mask = DocumentMask.from_spans(packed.spans, packed.positions)
    inputs = torch.from_numpy(packed.inputs)
    logits = stage_forward(params, inputs, StageShape(0, model.layers, True, True), model, docs=mask)
    losses = F.cross_entropy(logits.flatten(0, 1), torch.from_numpy(packed.targets).flatten(), reduction="none")
    losses = losses.view(packed.inputs.shape)
    return losses, mask


def _per_document(losses: torch.Tensor, packed, doc_of_span: list[int]) -> dict[int, torch.Tensor]:
    return {doc: losses[r, s : s + n] for doc, (r, s, n) in zip(doc_of_span, packed.spans.tolist())}


@pytest.mark.parametrize("name", list(MODELS))
def test_loss_per_token_is_the_same_however_documents_are_packed(name, grammar):
    model = MODELS[name]
    params = {i.name: init_full(i, model, 0).requires_grad_() for i in all_params(model)}
    source = GrammarDocuments(grammar, median=8, sigma=0.8, max_tokens=model.seq_len + 1)
    docs = step_documents(source, 0, 0, documents=12)
    forward, backward = list(range(len(docs))), list(reversed(range(len(docs))))
    packings = {  # (order the documents are placed in, row of each placed document)
        "ffd": (forward, first_fit_decreasing([len(d) for d in docs], model.seq_len)),
        "one per row": (forward, forward),
        "reversed": (backward, first_fit_decreasing([len(docs[i]) for i in backward], model.seq_len)),
    }
    alone = {}
    for i, d in enumerate(docs):  # the reference: each document by itself, plain causal attention
        logits = stage_forward(params, torch.from_numpy(d[None, :-1]), StageShape(0, model.layers, True, True), model)
        alone[i] = F.cross_entropy(logits[0], torch.from_numpy(d[1:]), reduction="none")
    grads = {}
    for how, (order, placed) in packings.items():
        packed = pack_placed([docs[i] for i in order], placed, max(placed) + 1, model.seq_len)
        # which document each span holds: spans are sorted by (row, start), placement order within a row
        starts = {}
        for k, i in enumerate(order):
            starts.setdefault(placed[k], []).append(i)
        doc_of_span = [starts[r].pop(0) for r, _, _ in packed.spans.tolist()]
        losses, _ = _token_losses(model, params, packed)
        per_doc = _per_document(losses, packed, doc_of_span)
        for i in range(len(docs)):
            torch.testing.assert_close(per_doc[i], alone[i], rtol=1e-5, atol=1e-6, msg=f"{how}: document {i}")
        assert torch.isfinite(losses).all()
        for p in params.values():
            p.grad = None
        losses.sum().backward()
        grads[how] = {n: p.grad.clone() for n, p in params.items()}
    for how in ("one per row", "reversed"):
        for n in params:
            torch.testing.assert_close(grads[how][n], grads["ffd"][n], rtol=1e-4, atol=1e-6, msg=f"{how}: {n}")


def test_document_attention_equals_a_block_diagonal_mask():
    torch.manual_seed(0)
    spans = np.array([[0, 0, 5], [0, 5, 9], [0, 14, 2], [1, 0, 16]])  # row 0 ends in padding
    positions = np.zeros((2, 20), dtype=np.int64)
    segment = np.full((2, 20), -1)
    for k, (r, s, n) in enumerate(spans.tolist()):
        positions[r, s : s + n] = np.arange(n)
        segment[r, s : s + n] = k
    q, k, v = (torch.randn(2, 4, 20, 8) for _ in range(3))
    got = DocumentMask.from_spans(spans, positions).attention(q, k, v)
    seg = torch.from_numpy(segment)
    allowed = (
        (seg[:, :, None] == seg[:, None, :]) & torch.ones(20, 20, dtype=torch.bool).tril() & (seg[:, :, None] >= 0)
    )
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None] | ~(seg[:, :, None] >= 0)[:, None])
    real = torch.from_numpy(segment >= 0)[:, None, :, None].expand_as(q)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-6)
    assert (got[~real] == 0).all()


def test_cli_names_a_file_without_documents_before_any_rank_starts(tmp_path):
    (tmp_path / "short.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    text = (
        (LAYOUTS / "reference" / "reference.toml")
        .read_text()
        .replace('kind = "grammar"', 'kind = "jsonl"\npath = "short.jsonl"\npacking = "documents"')
        .replace("vocab = 64", "vocab = 256")
    )
    path = tmp_path / "layout.toml"
    path.write_text(text)
    assert_one_error_line(
        invoke_cli(path, "--quiet"),
        f"{path}: data.path: file '{tmp_path / 'short.jsonl'}' has no "
        "document of 2 or more tokens (give a file with text between its separators)",
    )
