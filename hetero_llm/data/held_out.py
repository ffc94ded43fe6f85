"""Held-out evaluation: the loss on the same held-out batches whatever the layout.

Held-out tokens come from ``data.valid_path`` (a file of the same kind and tokenizer), or from the last
``data.valid_fraction`` of ``data.path``'s tokens, which training then never samples; for the embedded
grammar they are fresh samples of the grammar. Evaluation ``i`` of a run always uses the held-out batches
0 .. eval_batches - 1, each a pure function of (seed, batch index) on a data stream of its own, and each
pipeline runs its share of them forward only (its schedule's forward actions, without autograd), so the
held-out loss is the mean over the same tokens under every layout, as the training loss is.

With ``data.packing = "documents"`` held-out batches are whole documents packed into the global batch's
rows with document masks, as training's are (``held_out_rows``; the sources are ``sources.open_sources``): from
``data.valid_path``'s documents, the last ``data.valid_fraction`` of ``data.path``'s documents (training
then never draws them), or the grammar's. The loss is the mean over the held-out documents' targets.
A layout with [[buckets]] evaluates under its home layout (the top-level [[pipelines]]), which holds
the parameters between steps.
"""

from __future__ import annotations

import numpy as np

from hetero_llm.data import batches, documents

# Mixed into the held-out RNG seed: never the stream of a training batch, even when the source is shared.
_EVAL_STREAM = 0xE7A1


def batch(source, seed: int, index: int, global_batch: int, seq_len: int) -> np.ndarray:
    """Held-out batch ``index``: int64 (global_batch, seq_len + 1), the same on every process and layout."""
    rng = np.random.default_rng([batches._DATA_STREAM, _EVAL_STREAM, seed, index])
    return source.sample(rng, global_batch, seq_len + 1)


def held_out_rows(source, seed: int, index: int, global_batch: int, seq_len: int) -> documents.PackedRows:
    """Held-out batch ``index`` of packed documents: the same on every process and layout."""
    rng = np.random.default_rng([documents._DOCUMENT_STREAM, _EVAL_STREAM, seed, index])
    return documents.fill_rows_from(source, rng, global_batch, seq_len)
