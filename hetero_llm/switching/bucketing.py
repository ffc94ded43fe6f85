"""How a step's documents go to hot switching's buckets (docs/hot_switching.md). Torch-free.

``bucket_rows`` sorts the documents into the layout's buckets by length and packs each into rows of its
``max_len`` (first-fit decreasing, as HotSPa packs a bucket), a ``top_up`` bucket first filling its rows'
free positions with shorter buckets' documents; ``bucket_split`` gives each of a bucket's pipelines its
rows and microbatches, fixed or elastic.

**Sized by the step's documents** (the longest bucket and one under the home layout too): a bucket's rows are
the rows its documents need, rounded up to a multiple of its *unit* (``bucket_shares``), never to the global
batch. An elastic bucket's unit is its pipelines' batch shares over ``layout.elastic_divisor`` (its microbatches
keep ``batch / microbatches`` rows and their count follows the rows: home's batch 8 in 8 microbatches, a unit of
one row, so a step whose long documents fill 3 rows runs 3 microbatches); a fixed bucket's is the smallest shares in the same proportions that each
pipeline's microbatches still split evenly (home's batch 32 in 4 microbatches: 4 rows, one per microbatch), so a
step whose long documents fill 10 rows runs 12 in 4 microbatches of 3, not 32. Empty rows carry no targets and
a step's loss divides by its global target count: the rows a bucket runs do not change the model.
"""

from __future__ import annotations

import math

import numpy as np

from hetero_llm.data.documents import PackedRows, first_fit_decreasing, pack_placed
from hetero_llm.layout import elastic_divisor

__all__ = ["bucket_rows", "bucket_shares", "bucket_split", "placed"]


def bucket_shares(pipelines, elastic: bool) -> list[int]:
    """Each pipeline's rows in one unit of a bucket's rows (see the module doc): its ``batch`` over
    ``elastic_divisor`` for an elastic bucket; for a fixed one ``batch / g``, ``g`` the greatest common divisor of the pipelines' rows per
    microbatch (``batch / microbatches``), so each share still splits into the pipeline's microbatches."""
    if elastic:
        g = elastic_divisor(pipelines)
        return [p.batch // g for p in pipelines]
    g = math.gcd(*(p.batch // p.microbatches for p in pipelines))
    return [p.batch // g for p in pipelines]


def bucket_rows(layout, docs: list[np.ndarray]) -> list[PackedRows | None]:
    """Each bucket's documents packed first-fit decreasing into rows of its ``max_len`` (None: no documents),
    padded with empty rows to a multiple of the bucket's unit (``bucket_shares``' sum).

    A bucket with ``top_up`` then fills the free positions of its rows (padding, computed anyway) with shorter
    buckets' documents: longest first (ties in step order), each into the first row with room, without new
    rows; those documents leave their own bucket. Longer buckets top up first."""
    bounds = [b.max_len for b in layout.buckets]
    mine, rows_of = placed(bounds, [b.top_up for b in layout.buckets], docs)
    out: list[PackedRows | None] = []
    for i, group in enumerate(mine):
        if not group:
            out.append(None)
            continue
        bucket = layout.buckets[i]
        unit = sum(bucket_shares(bucket.pipelines or layout.pipelines, bucket.elastic))
        rows = -(-(max(rows_of[i]) + 1) // unit) * unit
        out.append(pack_placed([docs[k] for k in group], rows_of[i], rows, bounds[i]))
    return out


def placed(bounds: list[int], top_up: list[bool], docs: list[np.ndarray]) -> tuple[list[list[int]], list[list[int]]]:
    """``bucket_rows`` before padding: each bucket's documents (indices into ``docs``) and the row of each, sorted by
    length into the buckets of ``bounds``, packed first-fit decreasing, the ``top_up`` buckets topped up."""
    mine: list[list[int]] = [[] for _ in bounds]  # indices into docs
    for k, d in enumerate(docs):
        mine[next(i for i, bound in enumerate(bounds) if len(d) - 1 <= bound)].append(k)
    rows_of: list[list[int]] = [
        first_fit_decreasing([len(docs[k]) for k in group], bounds[i]) if group else [] for i, group in enumerate(mine)
    ]
    for i in reversed(range(len(bounds))):
        if top_up[i] and mine[i]:
            _top_up(docs, mine, rows_of, i, bounds)
    return mine, rows_of


def _top_up(docs: list[np.ndarray], mine: list[list[int]], rows_of: list[list[int]], i: int, bounds: list[int]) -> None:
    """Move shorter buckets' documents into the free positions of bucket ``i``'s rows (``bucket_rows``); what is
    left of each shorter bucket is packed anew (its rows may now be fewer)."""
    free = [bounds[i]] * (max(rows_of[i]) + 1)
    for k, r in zip(mine[i], rows_of[i]):
        free[r] -= len(docs[k]) - 1
    shorter = sorted((k for j in range(i) for k in mine[j]), key=lambda k: (-len(docs[k]), k))
    moved: set[int] = set()
    for k in shorter:
        need = len(docs[k]) - 1
        row = next((r for r, f in enumerate(free) if f >= need), None)
        if row is None:
            continue
        free[row] -= need
        mine[i].append(k)
        rows_of[i].append(row)
        moved.add(k)
    for j in range(i):
        mine[j] = [k for k in mine[j] if k not in moved]
        rows_of[j] = first_fit_decreasing([len(docs[k]) for k in mine[j]], bounds[j]) if mine[j] else []


def bucket_split(pipelines, num_rows: int, elastic: bool) -> tuple[int, list[tuple[int, int, int]]]:
    """How a bucket's ``num_rows`` rows (a multiple of its unit, ``bucket_shares``' sum: ``bucket_rows``) go to its
    pipelines: (rounds, [(first row, rows, microbatches)] per pipeline). Each pipeline takes ``share x rounds``
    rows, ``rounds = num_rows / sum(shares)``; a fixed bucket splits them into its ``microbatches``, an elastic
    one into ``microbatches x rounds`` of ``batch / microbatches`` rows each (``layout.elastic_layout``)."""
    shares = bucket_shares(pipelines, elastic)
    g = elastic_divisor(pipelines) if elastic else 1
    unit = sum(shares)
    if num_rows % unit:
        raise ValueError(f"{num_rows} rows are not a multiple of the pipelines' batch shares ({unit})")
    rounds = num_rows // unit
    out, offset = [], 0
    for p, share in zip(pipelines, shares):
        size = share * rounds
        out.append((offset, size, p.microbatches // g * rounds if elastic else p.microbatches))
        offset += size
    return rounds, out
