"""Layout validation of ``[data]`` and held-out evaluation: the data's kind, files, tokenizer, packing and
held-out set, checked against the model. Called by ``rules.validate`` at its place in the fixed order
of all rules (the first problem found is the one reported). Imports no torch.
"""

from __future__ import annotations

from pathlib import Path

from hetero_llm.errors import LayoutError
from hetero_llm.layout.fields import check_own
from hetero_llm.layout.schema import Compile, DataKind, Layout, Packing


def validate_data(layout: Layout) -> None:
    d, m, f = layout.data, layout.model, layout.file
    _validate_packing(layout)
    if d.kind is DataKind.GRAMMAR:
        _validate_grammar(layout)
        return
    _validate_path(layout)
    size = Path(d.path).stat().st_size
    if size == 0:
        raise LayoutError(
            f,
            "data.path",
            f"file '{d.path}' is empty (give a file with at least one window of {m.seq_len + 1} tokens: seq_len + 1)",
        )
    if d.kind is DataKind.TEXT and d.tokenizer == "bytes" and size < m.seq_len + 1:  # as many byte tokens as bytes
        raise LayoutError(
            f,
            "data.path",
            f"file '{d.path}' has {size} tokens, fewer than one window of "
            f"{m.seq_len + 1} tokens (seq_len + 1); give a longer file or a smaller seq_len",
        )
    if d.tokenizer == "bytes":
        if d.kind is DataKind.TOKENS:
            return  # the ids in the file bound model.vocab (checked when the file is opened)
        if m.vocab < 256:
            raise LayoutError(
                f, "model.vocab", f"{m.vocab} is smaller than the byte tokenizer's 256 tokens (set model.vocab >= 256)"
            )
        return
    from hetero_llm.data import tokenizers  # torch-free; the tokenizers library loads only for a tokenizer.json

    try:
        vocab = tokenizers.load(d.tokenizer).vocab_size
    except ValueError as e:
        raise LayoutError(f, "data.tokenizer", str(e)) from None
    if m.vocab < vocab:
        raise LayoutError(
            f, "model.vocab", f"{m.vocab} is smaller than the tokenizer's {vocab} tokens (set model.vocab >= {vocab})"
        )


def _validate_grammar(layout: Layout) -> None:
    """data.kind 'grammar': its branching within its vocabulary, and that within the model's."""
    d, m, f = layout.data, layout.model, layout.file
    check_own(f, d, "data", "grammar_vocab", "branching")
    if d.branching > d.grammar_vocab:
        raise LayoutError(
            f,
            "data.branching",
            f"{d.branching} exceeds grammar_vocab {d.grammar_vocab} (use at most {d.grammar_vocab})",
        )
    if m.vocab < d.grammar_vocab:
        raise LayoutError(
            f,
            "model.vocab",
            f"{m.vocab} is smaller than data.grammar_vocab {d.grammar_vocab} (set model.vocab >= {d.grammar_vocab})",
        )


def _validate_path(layout: Layout) -> None:
    """data.path names an existing file of the data's kind."""
    d, f = layout.data, layout.file
    if not d.path:
        raise LayoutError(
            f,
            "data.path",
            f"data.kind '{d.kind.value}' needs a file (set data.path to a "
            f".{ {DataKind.JSONL: 'jsonl', DataKind.TOKENS: 'bin'}.get(d.kind, 'txt') } file, relative to "
            "the layout file)",
        )
    if Path(d.path).is_dir():
        raise LayoutError(f, "data.path", f"'{d.path}' is a folder, not a file (give an existing text or JSONL file)")
    if d.kind is DataKind.TOKENS:
        if not Path(d.path).is_file():
            raise LayoutError(
                f,
                "data.path",
                f"file '{d.path}' does not exist (give a .bin or .npy token file, e.g. one hetero-tokenize wrote)",
            )
        if not d.path.endswith((".bin", ".npy")):
            raise LayoutError(
                f,
                "data.path",
                f"file '{d.path}' is neither .bin nor .npy (data.kind 'tokens' reads "
                "token files; use kind 'text' or 'jsonl' for text)",
            )
    elif not Path(d.path).is_file():
        raise LayoutError(f, "data.path", f"file '{d.path}' does not exist (give an existing text or JSONL file)")


def _validate_packing(layout: Layout) -> None:
    d, f = layout.data, layout.file
    if d.packing is not Packing.DOCUMENTS:
        return
    check_own(f, d, "data", "doc_len_median", "doc_len_sigma")
    if d.kind is DataKind.TOKENS:  # documents are found by separators in text or JSONL lines (documents.py)
        raise LayoutError(
            f,
            "data.packing",
            "'documents' finds whole documents in data.kind 'grammar', 'text' or "
            "'jsonl', not in a 'tokens' file (pack the text or JSONL file it was tokenized from, or set "
            "data.packing = 'none')",
        )
    if layout.train.compile is Compile.BLOCKS:
        raise LayoutError(
            f,
            "train.compile",
            "'blocks' cannot compile packed documents (their attention groups "
            "change shape every microbatch; set compile = 'none', or data.packing = 'none')",
        )


def validate_eval(layout: Layout) -> None:
    """Held-out evaluation: ``train.eval_every`` / ``eval_batches``, ``data.valid_path`` / ``valid_fraction``."""
    f, t, d = layout.file, layout.train, layout.data
    check_own(f, t, "train", "eval_every", "eval_batches")
    check_own(f, d, "data", "valid_fraction")
    if d.valid_path and d.valid_fraction:
        raise LayoutError(f, "data.valid_fraction", "is set as well as data.valid_path (hold out one way: remove one)")
    if d.kind is DataKind.GRAMMAR and (d.valid_path or d.valid_fraction):
        which = "valid_path" if d.valid_path else "valid_fraction"
        raise LayoutError(
            f,
            f"data.{which}",
            "is set but data.kind is 'grammar', whose held-out batches are fresh "
            f"samples of the grammar (remove data.{which})",
        )
    if d.valid_path and not Path(d.valid_path).is_file():
        raise LayoutError(
            f,
            "data.valid_path",
            f"file '{d.valid_path}' does not exist (give a held-out file of the same kind as data.path)",
        )
    if t.eval_every and d.kind is not DataKind.GRAMMAR and not (d.valid_path or d.valid_fraction):
        raise LayoutError(
            f,
            "train.eval_every",
            "needs held-out data (set data.valid_path, or data.valid_fraction = 0.05 to hold out the end of data.path)",
        )
