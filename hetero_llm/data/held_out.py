"""Held-out evaluation: the loss on the same held-out batches whatever the layout.

Held-out tokens come from ``data.valid_path`` (a file of the same kind and tokenizer), or from the last
``data.valid_fraction`` of ``data.path``'s tokens, which training then never samples; for the embedded
grammar they are fresh samples of the grammar. Evaluation ``i`` of a run always uses the held-out batches
0 .. eval_batches - 1, each a pure function of (seed, batch index) on a data stream of its own, and each
pipeline runs its share of them forward only (its schedule's forward actions, without autograd), so the
held-out loss is the mean over the same tokens under every layout, as the training loss is.

With ``data.packing = "documents"`` held-out batches are whole documents packed into the global batch's
rows with document masks, as training's are (``document_sources``, ``held_out_rows``): from
``data.valid_path``'s documents, the last ``data.valid_fraction`` of ``data.path``'s documents (training
then never draws them), or the grammar's. The loss is the mean over the held-out documents' targets.
A layout with [[buckets]] evaluates under its home layout (the top-level [[pipelines]]), which holds
the parameters between steps.
"""

from __future__ import annotations

import copy

import attrs
import numpy as np

from hetero_llm.data import batches, documents
from hetero_llm.errors import LayoutError

# Mixed into the held-out RNG seed: never the stream of a training batch, even when the source is shared.
_EVAL_STREAM = 0xE7A1


def train_and_held_out(spec, file_for_errors: str):
    """(training source, held-out source or None) of a layout's [data]."""
    train = batches.make_source(spec, file_for_errors)
    kind = getattr(spec.kind, "value", spec.kind)
    if kind == "grammar":
        return train, train  # an infinite source: held-out batches are other samples of the same grammar
    if spec.valid_path:
        return train, batches.make_source(attrs.evolve(spec, path=spec.valid_path, valid_path=""), file_for_errors)
    if spec.valid_fraction:
        assert isinstance(train, batches.TokenFileSource)  # a file's tokens: the grammar returned above
        cut = int(len(train.tokens) * (1 - spec.valid_fraction))
        head, tail = copy.copy(train), copy.copy(train)
        head.tokens, tail.tokens = train.tokens[:cut], train.tokens[cut:]
        return head, tail
    return train, None


def batch(source, seed: int, index: int, global_batch: int, seq_len: int) -> np.ndarray:
    """Held-out batch ``index``: int64 (global_batch, seq_len + 1), the same on every process and layout."""
    rng = np.random.default_rng([batches._DATA_STREAM, _EVAL_STREAM, seed, index])
    return source.sample(rng, global_batch, seq_len + 1)


def document_sources(spec, seq_len: int, file_for_errors: str):
    """(training document source, held-out document source or None) of a layout's [data] with packing."""
    train = documents.make_document_source(spec, seq_len, file_for_errors)
    kind = getattr(spec.kind, "value", spec.kind)
    if kind == "grammar":
        return train, train  # held-out rows are other samples of the same grammar (a stream of their own)
    if spec.valid_path:
        return train, documents.make_document_source(
            attrs.evolve(spec, path=spec.valid_path, valid_path=""), seq_len, file_for_errors
        )
    if spec.valid_fraction:
        assert isinstance(train, documents.FileDocuments)  # a file's documents: the grammar returned above
        try:
            return train.split(spec.valid_fraction)
        except ValueError as e:
            raise LayoutError(
                file_for_errors,
                "data.valid_fraction",
                f"{e} (give a file of two or more documents, or a held-out file as data.valid_path)",
            ) from None
    return train, None


def held_out_rows(source, seed: int, index: int, global_batch: int, seq_len: int) -> documents.PackedRows:
    """Held-out batch ``index`` of packed documents: the same on every process and layout."""
    rng = np.random.default_rng([documents._DOCUMENT_STREAM, _EVAL_STREAM, seed, index])
    return documents.fill_rows_from(source, rng, global_batch, seq_len)
