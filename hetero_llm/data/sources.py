"""Where the tokens come from: the typed spec of a run's data sources, and every source it gives.

``SourceSpec`` is the data layer's own record of ``[data]`` (this layer sits below ``layout/``, so it reads the
layout's ``DataSpec`` field by field, ``SourceSpec.of``). From it:

- ``make_source``: windows of tokens: the embedded grammar (``batches.GrammarSource``), a text or JSONL file
  tokenized at the byte level (``text_cache.TokenFileSource``) or by a tokenizer.json, or a token file
  (``token_files``);
- ``make_document_source``: whole documents (``data.packing = 'documents'``): the grammar's with long-tailed
  lengths, or a file's (``documents.GrammarDocuments``, ``documents.FileDocuments``);
- ``open_sources``: the training source and the held-out one (``data.valid_path``, the last ``data.valid_fraction``
  of the file, or for the grammar other samples of it), as ``Sources``, which draws a step's rows and a held-out
  batch's rows, packed or not (``batches.Windows`` and ``documents.PackedRows`` cut the same way).

Imports numpy and the standard library only (torch-free).
"""

from __future__ import annotations

import copy
from typing import Any

import attrs

from hetero_llm.data import documents, held_out
from hetero_llm.data.batches import GrammarSource, Windows, global_batch
from hetero_llm.data.documents import PackedRows
from hetero_llm.data.text_cache import TokenFileSource, unknown_kind_message
from hetero_llm.errors import LayoutError


@attrs.frozen
class SourceSpec:
    """What a run's data sources are made from (``[data]``; docs/layout.md documents each key)."""

    kind: str = "grammar"  # 'grammar', 'text', 'jsonl' or 'tokens' (the layout's DataKind is a str)
    path: str = ""  # the text, JSONL or token file; '' for the grammar
    field: str = "text"  # the JSONL key holding the text
    tokenizer: str = "bytes"  # 'bytes' or a tokenizer.json
    valid_path: str = ""  # a held-out file of the same kind; '' = none
    valid_fraction: float = 0.0  # hold out this last fraction of the file's tokens (or documents); 0 = none
    token_dtype: str = "uint16"  # the ids of a .bin token file
    grammar_seed: int = 1234
    grammar_vocab: int = 64
    branching: int = 4
    packing: str = "none"  # 'none': windows cut anywhere; 'documents': whole documents packed into rows
    separator: str = "\n\n"  # between a text file's documents (packing = 'documents')
    doc_len_median: float = 32.0  # the grammar's documents: median length in tokens
    doc_len_sigma: float = 1.0  # and the standard deviation of its log

    @classmethod
    def of(cls, data: Any) -> SourceSpec:
        """The spec of a layout's ``[data]`` record (``layout.DataSpec``), or of any record with its fields."""
        if isinstance(data, SourceSpec):
            return data
        return cls(**{f.name: getattr(data, f.name) for f in attrs.fields(cls)})

    @property
    def documents(self) -> bool:
        """Whole documents packed into rows (``data.packing = 'documents'``)."""
        return self.packing == "documents"


def make_source(spec: Any, file_for_errors: str) -> GrammarSource | TokenFileSource:
    """The window source ``spec`` (a ``SourceSpec`` or a layout's ``[data]``) describes; bad input is a located
    ``LayoutError``."""
    spec = SourceSpec.of(spec)
    if spec.kind == "grammar":
        if spec.grammar_vocab < 2:
            raise LayoutError(file_for_errors, "data.grammar_vocab", f"must be at least 2, got {spec.grammar_vocab}")
        if not 1 <= spec.branching <= spec.grammar_vocab:
            raise LayoutError(
                file_for_errors,
                "data.branching",
                f"must be between 1 and grammar_vocab ({spec.grammar_vocab}), got {spec.branching}",
            )
        return GrammarSource(spec.grammar_vocab, spec.branching, spec.grammar_seed)
    if spec.kind == "tokens":  # a .bin/.npy token file (token_files.py)
        from hetero_llm.data import token_files

        return token_files.open_tokens(spec.path, getattr(spec.token_dtype, "value", spec.token_dtype), file_for_errors)
    if spec.kind in ("text", "jsonl") and spec.tokenizer != "bytes":
        from hetero_llm.data import token_files

        kind = getattr(spec.kind, "value", spec.kind)
        return token_files.tokenized_source(spec.path, kind, spec.field, spec.tokenizer, file_for_errors)
    if spec.kind in ("text", "jsonl"):
        return TokenFileSource.from_file(spec.path, spec.kind, spec.field, file_for_errors)
    raise LayoutError(file_for_errors, "data.kind", unknown_kind_message(spec.kind))


def make_document_source(spec: Any, seq_len: int, file_for_errors: str) -> documents.DocumentSource:
    """The document source ``spec`` describes; documents hold at most seq_len + 1 tokens."""
    spec = SourceSpec.of(spec)
    kind = getattr(spec.kind, "value", spec.kind)
    if kind == "grammar":
        grammar = make_source(spec, file_for_errors)  # with its checks of the grammar keys
        assert isinstance(grammar, GrammarSource)  # data.kind 'grammar' makes one
        return documents.GrammarDocuments(grammar, spec.doc_len_median, spec.doc_len_sigma, seq_len + 1)
    return documents.FileDocuments.from_file(spec.path, kind, spec.field, spec.separator, seq_len + 1, file_for_errors)


def train_and_held_out(spec: Any, file_for_errors: str) -> tuple[Any, Any]:
    """(training window source, held-out source or None) of ``spec``."""
    spec = SourceSpec.of(spec)
    train = make_source(spec, file_for_errors)
    if getattr(spec.kind, "value", spec.kind) == "grammar":
        return train, train  # an infinite source: held-out batches are other samples of the same grammar
    if spec.valid_path:
        return train, make_source(attrs.evolve(spec, path=spec.valid_path, valid_path=""), file_for_errors)
    if spec.valid_fraction:
        assert isinstance(train, TokenFileSource)  # a file's tokens: the grammar returned above
        cut = int(len(train.tokens) * (1 - spec.valid_fraction))
        head, tail = copy.copy(train), copy.copy(train)
        head.tokens, tail.tokens = train.tokens[:cut], train.tokens[cut:]
        return head, tail
    return train, None


def document_sources(spec: Any, seq_len: int, file_for_errors: str) -> tuple[Any, Any]:
    """(training document source, held-out document source or None) of ``spec`` with packing."""
    spec = SourceSpec.of(spec)
    train = make_document_source(spec, seq_len, file_for_errors)
    if getattr(spec.kind, "value", spec.kind) == "grammar":
        return train, train  # held-out rows are other samples of the same grammar (a stream of their own)
    if spec.valid_path:
        return train, make_document_source(
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


@attrs.frozen
class Sources:
    """A run's training and held-out sources, and the rows each step and each held-out batch draws from them: the
    same on every process and layout (a pure function of the seed and the step or batch index)."""

    train: Any  # a window source (``TokenSource``) or, with ``documents``, a ``documents.DocumentSource``
    held_out: Any  # the same kind of source, or None (no held-out data)
    documents: bool  # whole documents packed into rows, with their spans

    def rows(self, seed: int, step: int, rows: int, seq_len: int) -> Windows | PackedRows:
        """Step ``step``'s ``rows`` rows of ``seq_len`` positions."""
        if self.documents:
            return documents.fill_rows(self.train, seed, step, rows, seq_len)
        return Windows(global_batch(self.train, seed, step, rows, seq_len))

    def held_out_rows(self, seed: int, index: int, rows: int, seq_len: int) -> Windows | PackedRows:
        """Held-out batch ``index``'s rows (``held_out.py``: a stream of its own, never a training batch)."""
        if self.documents:
            return held_out.held_out_rows(self.held_out, seed, index, rows, seq_len)
        return Windows(held_out.batch(self.held_out, seed, index, rows, seq_len))


def open_sources(spec: Any, seq_len: int, file_for_errors: str) -> Sources:
    """The training and held-out sources of ``spec`` (a ``SourceSpec`` or a layout's ``[data]``)."""
    spec = SourceSpec.of(spec)
    if spec.documents:
        train, held = document_sources(spec, seq_len, file_for_errors)
        return Sources(train, held, documents=True)
    train, held = train_and_held_out(spec, file_for_errors)
    return Sources(train, held, documents=False)
