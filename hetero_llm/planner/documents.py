"""``[plan.documents]``: the corpus' document lengths, and what attention over packed rows costs with them.
Torch-free (numpy).

With ``data.packing = 'documents'`` the runtime attends inside each document of a packed row
(model/document_mask.py): a row's attention costs the **sum of its documents' squared lengths**
(``DocumentMask.square_sum``, what the emulated device charges: predict/device.action_seconds), not ``S^2``.
The planner prices a row at the expected square sum of the declared corpus::

    [plan.documents]
    distribution = "lognormal"   # "row" (default: one document per row, S^2), "lognormal", "lengths"
    median = 2048                # lognormal: median document length in tokens
    sigma = 1.6                  # lognormal: standard deviation of the log of the length
    # distribution = "lengths"; file = "lengths.txt": a histogram, one "LENGTH [COUNT]" per line

A document of ``n`` tokens gives ``n - 1`` positions (inputs ``doc[:-1]``); one longer than a row is cut into
pieces of ``S + 1`` tokens (the last may be shorter; a piece of one token has nothing to predict and is dropped),
as data.documents cuts a file's documents. Rows are full of documents (the runtime packs first-fit until the
candidates stop fitting: a few positions of padding), so a row's expected square sum is ``S x E[l^2] / E[l]``
over the pieces' positions ``l`` (the length-weighted mean piece length, times S): ``S^2`` for one document
per row, ``S x median``-ish for short documents.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import attrs
import numpy as np

from hetero_llm.errors import LayoutError
from hetero_llm.layout import DataSpec, Packing
from hetero_llm.layout.reader import build
from hetero_llm.planner.catalogue import doc

ROW, LOGNORMAL, LENGTHS = "row", "lognormal", "lengths"
DISTRIBUTIONS = (ROW, LOGNORMAL, LENGTHS)
_GRID = 200_001  # points of the lognormal's quadrature over z in [-_Z, _Z] (kinks where pieces are cut: fine grid)
_Z = 9.0


@attrs.frozen
class DocumentsSpec:
    """``[plan.documents]``: the corpus' document lengths the planner prices attention with."""

    distribution: str = doc(
        "'row': one document per row, attention priced at S^2 per row (as without document masks); "
        "'lognormal': lengths in tokens round(exp(N(ln median, sigma))), at least 2; 'lengths': a histogram "
        "file (file). The runtime attends per document only with data.packing = 'documents'",
        default=ROW,
    )
    median: float = doc("lognormal: median document length in tokens (>= 2)", default=0.0)
    sigma: float = doc(
        "lognormal: standard deviation of the log of the length (>= 0; larger: a longer tail)", default=0.0
    )
    file: str = doc(
        "lengths: a text file, relative to the cluster file, of one document length in tokens per line, "
        "optionally followed by how many documents have it ('LENGTH COUNT'); '#' starts a comment",
        default="",
    )


@attrs.frozen
class Documents:
    """A corpus' document lengths as the cost model reads them: ``square_sum(S)``, a row's expected sum of
    squared document lengths in positions (``S^2`` for one document per row)."""

    distribution: str = ROW
    lengths: tuple[int, ...] = ()  # token counts (lengths: the histogram's; lognormal: none, see median/sigma)
    counts: tuple[float, ...] = ()
    median: float = 0.0
    sigma: float = 0.0

    @property
    def per_row(self) -> bool:
        """Today's pricing: one document per row."""
        return self.distribution == ROW

    def weighted(self, S: int) -> tuple[np.ndarray, np.ndarray]:
        """(token counts, weights) of the documents (lognormal: a quadrature over the normal's z)."""
        if self.distribution == LENGTHS:
            return np.asarray(self.lengths, dtype=np.float64), np.asarray(self.counts, dtype=np.float64)
        z = np.linspace(-_Z, _Z, _GRID)
        n = np.maximum(2.0, np.rint(np.exp(math.log(self.median) + self.sigma * z)))
        return n, np.exp(-0.5 * z * z)

    def square_sum(self, S: int) -> float:
        """A full row's expected sum of squared document lengths (positions), ``S x E[l^2] / E[l]`` over the
        pieces' positions ``l`` (module docstring)."""
        if self.per_row:
            return float(S) * S
        n, w = self.weighted(S)
        if self.distribution == LOGNORMAL and self.sigma == 0:
            n, w = np.asarray([max(2.0, float(round(self.median)))]), np.asarray([1.0])
        positions, squares = piece_sums(n, S)
        return float(S * (w * squares).sum() / (w * positions).sum())

    def cp_imbalance(self, S: int, cp: int, rows: int, batch: int) -> float:
        """The slowest CP rank's attention over the mean rank's, for microbatches of ``rows`` packed rows.

        Ring attention couples a stage's CP ranks every layer (each ring step waits for its neighbour's keys and
        values, the backward for its key/value gradients), so a layer lasts as long as its slowest rank's blocks.
        The zigzag split gives every rank the same share of a causal row (1 with one document per row), but a
        packed row's documents fall where they fall: a rank whose chunks hold the long documents' late positions
        sees more pairs. Sampled: steps of ``batch`` rows filled as training fills them (data.documents._fill:
        each drawn document's pieces (as ``square_sum`` cuts them) into the first row with room, until
        ``_FILL_MISSES`` in a row fit nowhere), each
        rank's visible pairs summed over each microbatch's ``rows`` rows, E[max] / E[mean] over up to
        ``_IMBALANCE_MICROBATCHES`` microbatches (seeded)."""
        if cp < 2 or self.per_row or rows > batch:
            return 1.0
        return _cp_imbalance(self, S, cp, rows, batch)


@functools.lru_cache(maxsize=256)
def _cp_imbalance(docs: Documents, S: int, cp: int, rows: int, batch: int) -> float:
    n, w = docs.weighted(S)
    if docs.distribution == LOGNORMAL and docs.sigma == 0:
        n, w = np.asarray([max(2.0, float(round(docs.median)))]), np.asarray([1.0])
    tokens = n.astype(np.int64)
    p = w / w.sum()
    rng = np.random.default_rng(0)
    steps = max(4, min(_IMBALANCE_MICROBATCHES * rows, _IMBALANCE_POSITIONS // S) // batch)  # bounded work
    owner, ramp = zigzag_owner(S, cp), np.arange(1, S + 1, dtype=np.float64)
    worst = mean = 0.0
    for _ in range(steps):
        seen = np.zeros((batch, S))
        free = [S] * batch
        misses = 0
        while misses < _FILL_MISSES and max(free) >= 1:  # data.documents._fill: first fit, in drawing order
            for m in _piece_positions(tokens[rng.choice(len(p), size=_FILL_DRAW, p=p)], S):
                r = next((i for i, f in enumerate(free) if f >= m), -1)
                if r < 0:
                    misses += 1
                    if misses >= _FILL_MISSES:
                        break
                    continue
                misses, at = 0, S - free[r]
                seen[r, at : at + m] = ramp[:m]
                free[r] -= m
        per_rank = np.stack([seen[:, owner == k].sum(1) for k in range(cp)], axis=1)  # (batch, cp)
        for lo in range(0, batch - rows + 1, rows):  # the step's microbatches of `rows` rows
            per = per_rank[lo : lo + rows].sum(0)
            worst, mean = worst + per.max(), mean + per.mean()
    return float(worst / mean) if mean > 0 else 1.0


_IMBALANCE_MICROBATCHES = 400  # sampled microbatches of cp_imbalance (seeded: the planner is deterministic)
_IMBALANCE_POSITIONS = 2_000_000  # at most this many sampled positions (long rows: fewer microbatches)
_FILL_DRAW, _FILL_MISSES = 64, 16  # data.documents._DRAW, _MISSES: candidates drawn at a time, misses that end a fill


def zigzag_owner(S: int, cp: int) -> np.ndarray:
    """(S,) the CP index holding each position of a row: chunks r and 2 cp - 1 - r of 2 cp (model/cp_chunks.py)."""
    chunk = np.arange(S) * (2 * cp) // S
    return np.minimum(chunk, 2 * cp - 1 - chunk)


def rank_pairs(starts: np.ndarray, S: int, cp: int) -> np.ndarray:
    """(cp,) visible query/key pairs per CP rank of one row whose documents start at ``starts`` (sorted, the first
    0): a query at position q sees the keys of its document up to itself, ``q - start + 1``, on the rank holding
    its position (ring attention computes each rank's own queries against every key)."""
    pos = np.arange(S)
    start_of = starts[np.searchsorted(starts, pos, side="right") - 1]
    return np.bincount(zigzag_owner(S, cp), weights=(pos - start_of + 1).astype(np.float64), minlength=cp)


def _piece_positions(n: np.ndarray, S: int) -> list[int]:
    """The positions of the pieces of documents of ``n`` tokens, in order (``piece_sums``' pieces: of at most
    ``S + 1`` tokens, one of fewer than 2 dropped)."""
    out: list[int] = []
    for tokens in n.tolist():
        full, rest = divmod(tokens, S + 1)
        out += [S] * full + ([rest - 1] if rest >= 2 else [])
    return out


def piece_sums(n: np.ndarray, S: int) -> tuple[np.ndarray, np.ndarray]:
    """Per document of ``n`` tokens: (positions, sum of squared positions) of its pieces of at most ``S + 1``
    tokens (pieces of fewer than 2 tokens dropped)."""
    full = np.floor(n / (S + 1))
    rest = n - full * (S + 1)
    tail = np.where(rest >= 2, rest - 1, 0.0)
    return full * S + tail, full * float(S) * S + tail * tail


def read_documents(file: str, raw: object, data: DataSpec) -> Documents:
    """``[plan.documents]`` (``raw``) checked and read; per-document pricing needs the runtime's document masks."""
    docs = documents_of(file, build(DocumentsSpec, raw, "plan.documents", file))
    if not docs.per_row and data.packing is not Packing.DOCUMENTS:
        raise LayoutError(
            file,
            "plan.documents.distribution",
            f"{docs.distribution!r} prices attention per document, but data.packing is "
            f"'{data.packing.value}': the runtime attends across the whole row (set data.packing = 'documents', "
            "or remove [plan.documents])",
        )
    return docs


def documents_of(file: str, spec: DocumentsSpec) -> Documents:
    """``spec`` checked (a ``LayoutError`` naming the key otherwise) and read (a histogram file)."""
    where = "plan.documents"
    if spec.distribution not in DISTRIBUTIONS:
        raise LayoutError(
            file,
            f"{where}.distribution",
            f"unknown distribution {spec.distribution!r} (one of: {', '.join(DISTRIBUTIONS)})",
        )
    used = {ROW: (), LOGNORMAL: ("median", "sigma"), LENGTHS: ("file",)}[spec.distribution]
    for key in ("median", "sigma", "file"):
        given = getattr(spec, key) != attrs.fields_dict(DocumentsSpec)[key].default
        if given and key not in used:
            raise LayoutError(
                file, f"{where}.{key}", f"is not read by distribution = {spec.distribution!r} (remove it)"
            )
    if spec.distribution == LOGNORMAL:
        if not spec.median >= 2:
            raise LayoutError(
                file, f"{where}.median", f"must be a length in tokens >= 2, got {spec.median:g} (e.g. median = 2048)"
            )
        if not spec.sigma >= 0:
            raise LayoutError(
                file, f"{where}.sigma", f"must be >= 0 (0: every document the median), got {spec.sigma:g}"
            )
        return Documents(LOGNORMAL, median=spec.median, sigma=spec.sigma)
    if spec.distribution == LENGTHS:
        if not spec.file:
            raise LayoutError(file, f"{where}.file", 'distribution = "lengths" needs a histogram file (file = "...")')
        lengths, counts = read_histogram(file, f"{where}.file", Path(file).parent / spec.file)
        return Documents(LENGTHS, lengths, counts)
    return Documents()


def read_histogram(file: str, where: str, path: Path) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """A histogram file's (lengths, counts); a ``LayoutError`` at ``where`` naming the bad line."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise LayoutError(file, where, f"cannot read {str(path)!r}: {getattr(e, 'strerror', None) or e}") from None
    lengths, counts = [], []
    for i, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            if len(fields) > 2:
                raise ValueError
            n, c = int(fields[0]), float(fields[1]) if len(fields) == 2 else 1.0
        except ValueError:
            raise LayoutError(
                file, where, f"{path.name} line {i}: expected 'LENGTH' or 'LENGTH COUNT', got {line.strip()!r}"
            ) from None
        if n < 2 or not (c >= 0 and math.isfinite(c)):
            raise LayoutError(
                file,
                where,
                f"{path.name} line {i}: a length of at least 2 tokens and a count >= 0, got {line.strip()!r}",
            )
        lengths.append(n)
        counts.append(c)
    if not sum(counts) > 0:
        raise LayoutError(file, where, f"{path.name} holds no document (one 'LENGTH [COUNT]' per line)")
    return tuple(lengths), tuple(counts)
