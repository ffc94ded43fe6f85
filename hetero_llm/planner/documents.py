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
