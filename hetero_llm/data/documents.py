"""Whole documents: where they come from, which of them a step trains on, and how they pack into rows.

``data.packing = 'documents'`` trains on whole documents rather than windows cut across them:

- A *document source* yields documents (token arrays of at least 2 tokens, at most ``seq_len + 1``):
  ``FileDocuments`` reads a JSONL file (one document per line) or a text file split on a separator;
  ``GrammarDocuments`` is the embedded default: sequences of the seeded grammar (``batches.GrammarSource``)
  with long-tailed lengths (a discretized lognormal), whose best reachable loss is known exactly.
- ``step_documents`` (a count of documents or a budget of tokens) and ``fill_rows`` (as many rows of a
  width as the step holds) make a step's documents a pure function of (seed, step), on every process.
- ``pack`` / ``pack_placed`` lay documents into rows. A document of n tokens gives n - 1 positions
  (inputs ``doc[:-1]``, targets ``doc[1:]``); its positions restart at 0; the tail of a row is padding
  whose target is ``IGNORE``. ``PackedRows.spans`` says where each document lies, which is all the
  model needs for its document mask (``model.document_mask.DocumentMask``): attention never crosses a document, so
  a token's loss is the same however the documents were packed.

Imports numpy and the standard library only (torch-free, like all of ``data/``).
"""

from __future__ import annotations

import math
from typing import Protocol

import attrs
import numpy as np

from hetero_llm.data.batches import GrammarSource
from hetero_llm.data.text_cache import END_OF_DOCUMENT, TokenFileSource
from hetero_llm.errors import LayoutError

# Target of a padding position: F.cross_entropy's default ignore_index, so the loss skips it.
IGNORE = -100
# Mixed into the RNG seed of a step's documents: a stream of its own, apart from the window stream.
_DOCUMENT_STREAM = 0xD0C5
# Candidates drawn at a time. Part of what a step's documents are: changing it changes the data.
_DRAW = 64
# fill_rows stops after this many candidates in a row fit in no row (the rows are nearly full).
_MISSES = 16


class DocumentSource(Protocol):
    """What ``step_documents`` and ``fill_rows`` need: candidates (cheap: lengths), then their tokens."""

    @property
    def vocab_size(self) -> int: ...

    def candidates(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` candidate documents: (ids, lengths in tokens), int64 each."""

    def documents(self, rng: np.random.Generator, ids: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        """The int64 tokens of the candidates ``ids`` (with their ``lengths``)."""


# --------------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------------


class GrammarDocuments:
    """Grammar sequences with lognormal lengths (``median`` tokens, log-std ``sigma``) clipped to [2, max_tokens].

    Each document starts in the grammar's stationary distribution, so its first target is predicted
    from one token and every later one from two: the floor of a document of n tokens is
    (H(X1|X0) + (n - 2) * rate) / (n - 1) per target, and a batch's floor weights that by targets.
    """

    def __init__(self, grammar: GrammarSource, median: float, sigma: float, max_tokens: int):
        if max_tokens < 2:
            raise ValueError(f"documents need at least 2 tokens, got max_tokens {max_tokens}")
        self.grammar = grammar
        self.lengths = np.arange(2, max_tokens + 1)
        self.pmf = _lognormal_pmf(self.lengths, median, sigma)

    @property
    def vocab_size(self) -> int:
        return self.grammar.vocab_size

    def candidates(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        lengths = rng.choice(self.lengths, size=n, p=self.pmf)
        return np.arange(n, dtype=np.int64), lengths.astype(np.int64)

    def documents(self, rng: np.random.Generator, ids: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        if len(lengths) == 0:
            return []
        # One draw for all: a prefix of a stationary chain is a stationary chain of that length.
        rows = self.grammar.sample(rng, len(lengths), int(max(lengths)))
        return [rows[i, :n].copy() for i, n in enumerate(lengths)]

    def batch_loss_floor(self, lengths) -> float:
        """The best mean loss per target reachable on documents of these lengths (nats)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        g = self.grammar
        return float(
            (g.first_target_entropy() * len(lengths) + g.entropy_rate() * (lengths - 2).sum()) / (lengths - 1).sum()
        )

    def expected_loss_floor(self) -> float:
        """The floor expected over the length distribution (targets-weighted), nats per target."""
        g = self.grammar
        n = self.lengths.astype(np.float64)
        return float(
            (self.pmf * (g.first_target_entropy() + (n - 2) * g.entropy_rate())).sum() / (self.pmf * (n - 1)).sum()
        )


def _lognormal_pmf(lengths: np.ndarray, median: float, sigma: float) -> np.ndarray:
    """P(round(exp(N(ln median, sigma))) = n) for each n in ``lengths``, the tails folded onto the ends."""
    if sigma == 0:
        pmf = np.zeros(len(lengths))
        pmf[np.clip(round(median), lengths[0], lengths[-1]) - lengths[0]] = 1.0
        return pmf
    cdf = np.array(
        [0.5 * (1 + math.erf((math.log(x) - math.log(median)) / (sigma * math.sqrt(2)))) for x in lengths[:-1] + 0.5]
    )
    pmf = np.diff(np.concatenate([[0.0], cdf, [1.0]]))
    return pmf / pmf.sum()


class FileDocuments:
    """Documents of a byte-level token file: JSONL lines, or a text file split on ``separator``.

    A document longer than ``max_tokens`` is cut into pieces of ``max_tokens`` (the last may be
    shorter); pieces of fewer than 2 tokens (nothing to predict) are dropped. Documents are drawn
    uniformly, with replacement.
    """

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, path: str):
        self.tokens, self.starts, self.lengths, self.path = tokens, starts, lengths, path

    @classmethod
    def from_file(
        cls, path: str, kind: str, field: str, separator: str, max_tokens: int, file_for_errors: str = "layout.toml"
    ) -> FileDocuments:
        source = TokenFileSource.from_file(path, kind, field, file_for_errors)
        tokens = source.tokens
        if kind == "jsonl":
            ends = np.flatnonzero(tokens == END_OF_DOCUMENT)
            starts, lengths = _spans_between(ends, 1, len(tokens))
        else:
            ends = _find_all(tokens, np.frombuffer(separator.encode("utf-8"), dtype=np.uint8))
            starts, lengths = _spans_between(ends, len(separator.encode("utf-8")), len(tokens))
        starts, lengths = _cut(starts, lengths, max_tokens)
        if len(starts) == 0:
            raise LayoutError(
                file_for_errors,
                "data.path",
                f"file '{path}' has no document of 2 or more tokens (give a file with text between its separators)",
            )
        return cls(tokens, starts, lengths, path)

    @property
    def vocab_size(self) -> int:
        return 256

    @property
    def num_documents(self) -> int:
        return len(self.starts)

    def split(self, fraction: float) -> tuple[FileDocuments, FileDocuments]:
        """(the documents before, the last ``fraction`` of the documents in file order): training's and
        held-out ones (``data.valid_fraction``); each keeps at least one."""
        if self.num_documents < 2:
            raise ValueError(f"'{self.path}' has {self.num_documents} document: nothing to hold out")
        cut = min(max(int(round(self.num_documents * (1 - fraction))), 1), self.num_documents - 1)
        return (
            FileDocuments(self.tokens, self.starts[:cut], self.lengths[:cut], self.path),
            FileDocuments(self.tokens, self.starts[cut:], self.lengths[cut:], self.path),
        )

    def candidates(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        ids = rng.integers(0, self.num_documents, size=n)
        return ids, self.lengths[ids]

    def documents(self, rng: np.random.Generator, ids: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        return [self.tokens[self.starts[i] : self.starts[i] + self.lengths[i]].astype(np.int64) for i in ids]


def _find_all(tokens: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """Starts of the non-overlapping occurrences of ``pattern`` in ``tokens``, left to right."""
    k = len(pattern)
    if k == 0 or len(tokens) < k:
        return np.zeros(0, dtype=np.int64)
    hits = np.flatnonzero(tokens[: len(tokens) - k + 1] == pattern[0])
    for j in range(1, k):
        hits = hits[tokens[hits + j] == pattern[j]]
    kept, end = [], -1
    for h in hits.tolist():  # one per match: a run of separators ("\n\n\n") matches once, not twice
        if h >= end:
            kept.append(h)
            end = h + k
    return np.asarray(kept, dtype=np.int64)


def _spans_between(cuts: np.ndarray, width: int, total: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the pieces of [0, total) between separators of ``width`` tokens at ``cuts``."""
    starts = np.concatenate([[0], cuts + width]).astype(np.int64)
    ends = np.concatenate([cuts, [total]]).astype(np.int64)
    keep = ends > starts
    return starts[keep], (ends - starts)[keep]


def _cut(starts: np.ndarray, lengths: np.ndarray, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    pieces = -(-lengths // max_tokens)
    offsets = (
        np.concatenate([np.arange(p) * max_tokens for p in pieces.tolist()]).astype(np.int64)
        if len(pieces)
        else np.zeros(0, dtype=np.int64)
    )
    base = np.repeat(starts, pieces)
    total = np.repeat(lengths, pieces)
    piece_len = np.minimum(total - offsets, max_tokens)
    keep = piece_len >= 2
    return (base + offsets)[keep], piece_len[keep]


# --------------------------------------------------------------------------------------------------
# A step's documents
# --------------------------------------------------------------------------------------------------


def _step_rng(seed: int, step: int) -> np.random.Generator:
    return np.random.default_rng([_DOCUMENT_STREAM, seed, step])


def step_documents(
    source: DocumentSource, seed: int, step: int, *, documents: int = 0, tokens: int = 0
) -> list[np.ndarray]:
    """One step's documents, a pure function of (seed, step): ``documents`` of them, or as many as fit a
    budget of ``tokens`` targets (a document of n tokens has n - 1; the first that would exceed it ends
    the step). Give exactly one of the two."""
    if (documents > 0) == (tokens > 0):
        raise ValueError(f"give exactly one of documents ({documents}) and tokens ({tokens})")
    rng = _step_rng(seed, step)
    if documents:
        ids, lengths = source.candidates(rng, documents)
        return source.documents(rng, ids, lengths)
    taken_ids: list[int] = []
    taken_lengths: list[int] = []
    used = 0
    while True:
        ids, lengths = source.candidates(rng, _DRAW)
        for i, n in zip(ids.tolist(), lengths.tolist()):
            if used + n - 1 > tokens:
                if not taken_ids:
                    raise ValueError(f"a budget of {tokens} tokens holds no document (the first has {n - 1} targets)")
                return source.documents(rng, np.asarray(taken_ids), np.asarray(taken_lengths))
            taken_ids.append(i)
            taken_lengths.append(n)
            used += n - 1


def fill_rows(source: DocumentSource, seed: int, step: int, rows: int, width: int) -> PackedRows:
    """One step's documents packed into ``rows`` rows of ``width`` positions: a pure function of (seed,
    step, rows, width). Candidates are placed first-fit in the order drawn until ``_MISSES`` in a row fit
    nowhere, so a static layout's global batch (rows) stays the same whatever the documents."""
    return fill_rows_from(source, _step_rng(seed, step), rows, width)


def fill_rows_from(source: DocumentSource, rng: np.random.Generator, rows: int, width: int) -> PackedRows:
    """``fill_rows`` with candidates drawn from ``rng`` (held-out rows draw from a stream of their own)."""
    return pack_placed(*_fill(source, rng, rows, width), rows, width)


def fill_documents(source: DocumentSource, seed: int, step: int, rows: int, width: int) -> list[np.ndarray]:
    """The documents ``fill_rows`` packs, for a layout that packs them otherwise (hot switching's buckets)."""
    return _fill(source, _step_rng(seed, step), rows, width)[0]


def _fill(
    source: DocumentSource, rng: np.random.Generator, rows: int, width: int
) -> tuple[list[np.ndarray], list[int]]:
    free = np.full(rows, width, dtype=np.int64)
    ids, lengths, placed, misses = [], [], [], 0
    while misses < _MISSES and free.max() >= 1:
        batch_ids, batch_lengths = source.candidates(rng, _DRAW)
        for i, n in zip(batch_ids.tolist(), batch_lengths.tolist()):
            fits = np.flatnonzero(free >= n - 1)
            if fits.size == 0:
                misses += 1
                if misses >= _MISSES:
                    break
                continue
            misses = 0
            free[fits[0]] -= n - 1
            ids.append(i)
            lengths.append(n)
            placed.append(int(fits[0]))
    docs = source.documents(rng, np.asarray(ids, dtype=np.int64), np.asarray(lengths, dtype=np.int64))
    return docs, placed


# --------------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class PackedRows:
    """Documents laid into rows of one width, with what a document mask needs.

    ``inputs``, ``targets``, ``positions``: (rows, width) int64; ``targets`` is ``IGNORE`` at padding,
    ``positions`` restart at 0 in every document. ``spans``: (documents, 3) int64 of (row, start,
    length) in positions, sorted by row then start.
    """

    inputs: np.ndarray
    targets: np.ndarray
    positions: np.ndarray
    spans: np.ndarray

    @property
    def num_rows(self) -> int:
        return self.inputs.shape[0]

    @property
    def num_targets(self) -> int:
        """Positions with a target: what the step's mean loss divides by."""
        return int(self.spans[:, 2].sum())

    def take(self, lo: int, hi: int) -> PackedRows:
        """Rows [lo, hi), their spans renumbered from row 0."""
        if not 0 <= lo <= hi <= self.num_rows:
            raise ValueError(f"rows [{lo}, {hi}) do not fit {self.num_rows} rows")
        inside = (self.spans[:, 0] >= lo) & (self.spans[:, 0] < hi)
        spans = self.spans[inside].copy()
        spans[:, 0] -= lo
        return PackedRows(self.inputs[lo:hi], self.targets[lo:hi], self.positions[lo:hi], spans)

    def share(self, offset: int, size: int, microbatches: int) -> list[PackedRows]:
        """Rows [offset, offset + size) as ``microbatches`` equal contiguous pieces (``data.pipeline_share``)."""
        if microbatches < 1 or size % microbatches:
            raise ValueError(f"pipeline batch {size} is not divisible into {microbatches} microbatches")
        step = size // microbatches
        return [self.take(offset + i * step, offset + (i + 1) * step) for i in range(microbatches)]


def pack_placed(docs: list[np.ndarray], rows_of: list[int], rows: int, width: int) -> PackedRows:
    """``docs`` laid into ``rows`` rows of ``width`` positions, document i into row ``rows_of[i]`` after the
    documents placed there before it."""
    inputs = np.zeros((rows, width), dtype=np.int64)
    targets = np.full((rows, width), IGNORE, dtype=np.int64)
    positions = np.zeros((rows, width), dtype=np.int64)
    used = np.zeros(rows, dtype=np.int64)
    spans = []
    for doc, r in zip(docs, rows_of):
        n = len(doc) - 1
        if n < 1:
            raise ValueError(f"a document needs at least 2 tokens, got {len(doc)}")
        start = int(used[r])
        if start + n > width:
            raise ValueError(f"a document of {len(doc)} tokens does not fit row {r} ({width - start} positions left)")
        inputs[r, start : start + n] = doc[:-1]
        targets[r, start : start + n] = doc[1:]
        positions[r, start : start + n] = np.arange(n)
        spans.append((r, start, n))
        used[r] += n
    spans_arr = np.asarray(sorted(spans), dtype=np.int64).reshape(-1, 3)
    return PackedRows(inputs, targets, positions, spans_arr)


def first_fit_decreasing(lengths: list[int], width: int) -> list[int]:
    """A row for each document of ``lengths`` tokens: longest first, each into the first row it fits
    (a new row when none does), ties in the given order; as HotSPa packs a bucket."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    free: list[int] = []
    rows_of = [0] * len(lengths)
    for i in order:
        need = lengths[i] - 1
        if need > width:
            raise ValueError(f"a document of {lengths[i]} tokens does not fit a row of {width} positions")
        row = next((r for r, f in enumerate(free) if f >= need), None)
        if row is None:
            free.append(width)
            row = len(free) - 1
        free[row] -= need
        rows_of[i] = row
    return rows_of


def pack(docs: list[np.ndarray], width: int, rows: int = 0) -> PackedRows:
    """``docs`` packed first-fit decreasing into rows of ``width`` positions: as few rows as that takes, or
    exactly ``rows`` (more are padding; fewer is an error)."""
    rows_of = first_fit_decreasing([len(d) for d in docs], width)
    needed = max(rows_of, default=-1) + 1
    if rows and needed > rows:
        raise ValueError(f"{len(docs)} documents need {needed} rows of {width} positions, more than {rows}")
    return pack_placed(docs, rows_of, rows or needed, width)
