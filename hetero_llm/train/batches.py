"""A rank's batches: one object, built from its ``RankPlan``, gives each step's microbatches and the held-out
batches, packed documents or not.

The rows of a step (or of a held-out batch) are the same on every process and layout (``data.sources.Sources``);
the rank takes its pipeline's rows (``rp.batch``: offset, size, microbatches) and makes each microbatch: its
inputs and targets as tensors, with the document mask of packed rows, or on a context-parallel stage (``ring``)
this rank's columns of them (``runtime.context_rows``). Windows and packed rows are cut the same way
(``data.batches.Windows``, ``data.documents.PackedRows``), so both take one path.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hetero_llm.comm.ring import Ring
from hetero_llm.data import sources
from hetero_llm.model.document_mask import DocumentMask
from hetero_llm.plan.rank import RankPlan
from hetero_llm.runtime import context_rows
from hetero_llm.runtime.interpreter import Microbatch


class Batches:
    """Rank ``rp``'s microbatches of every training step and of the held-out batches (``ring``: its stage's
    context-parallel ring, whose columns it takes)."""

    def __init__(self, rp: RankPlan, ring: Ring | None = None):
        self.rp, self.ring = rp, ring
        self.sources = sources.open_sources(sources.SourceSpec.of(rp.data), rp.model.seq_len, rp.file)

    @property
    def source(self):
        """The training source (hot switching draws each step's documents from it, ``switching/switcher.py``)."""
        return self.sources.train

    @property
    def has_held_out(self) -> bool:
        return self.sources.held_out is not None

    def step(self, step: int) -> tuple[list[Microbatch], int]:
        """Step ``step``'s microbatches of this rank, and the targets of the whole step (what its mean loss divides
        by: packed documents count their targets, not the rows' padding)."""
        tr = self.rp.train
        rows = self.sources.rows(tr.seed, step, tr.global_batch, self.rp.model.seq_len)
        return self._microbatches(rows), rows.num_targets

    def held_out(self) -> Iterator[tuple[list[Microbatch], int]]:
        """The held-out batches 0 .. ``train.eval_batches`` - 1, each as ``step`` gives a step's."""
        tr = self.rp.train
        for index in range(tr.eval_batches):
            rows = self.sources.held_out_rows(tr.seed, index, tr.global_batch, self.rp.model.seq_len)
            yield self._microbatches(rows), rows.num_targets

    def _microbatches(self, rows) -> list[Microbatch]:
        share = self.rp.batch
        return [self._microbatch(piece) for piece in rows.share(share.offset, share.size, share.microbatches)]

    def _microbatch(self, piece) -> Microbatch:
        if self.ring is not None:  # this rank's columns of the rows, and their documents
            inputs, targets, shard = context_rows.context_columns(
                self.ring, self.rp.model.seq_len, piece.inputs, piece.targets, piece.spans, piece.positions
            )
            return Microbatch(inputs, targets, ctx=shard)
        docs = DocumentMask.from_spans(piece.spans, piece.positions) if piece.spans is not None else None
        return Microbatch(torch.from_numpy(piece.inputs), torch.from_numpy(piece.targets), docs)
