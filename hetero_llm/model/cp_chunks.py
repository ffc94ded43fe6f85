"""Which positions of a row each context-parallel (CP) rank holds: zigzag causal load balancing.

A row of ``seq_len`` positions is cut into ``2 * cp`` equal chunks; CP rank ``r`` holds chunk ``r`` and chunk
``2 * cp - 1 - r``, in that order (Megatron's context parallelism and zigzag ring attention do the same). Why two
chunks from opposite ends: under a causal mask chunk ``c`` attends to ``c + 1`` chunks, so a rank holding a
early and a late chunk does ``(r + 1) + (2 cp - r) = 2 cp + 1`` chunk pairs of work whatever its ``r``: the ranks
of a ring stay in step. ``cp == 1`` is the whole row in order. Torch-free (the plan compiler imports it).
"""

from __future__ import annotations

import numpy as np


def divisible(seq_len: int, cp: int) -> bool:
    """Whether a row of ``seq_len`` positions cuts into ``2 * cp`` equal chunks."""
    return cp >= 1 and seq_len % (2 * cp) == 0


def chunk_ranges(seq_len: int, cp: int, r: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two ``[lo, hi)`` position ranges CP rank ``r`` of ``cp`` holds, in its local order."""
    if not divisible(seq_len, cp) or not 0 <= r < cp:
        raise ValueError(f"CP rank {r} of {cp}: seq_len {seq_len} must be a multiple of 2*cp = {2 * cp}")
    size = seq_len // (2 * cp)
    first, second = r, 2 * cp - 1 - r
    return (first * size, (first + 1) * size), (second * size, (second + 1) * size)


def local_positions(seq_len: int, cp: int, r: int) -> np.ndarray:
    """(seq_len // cp,) int64: the global positions rank ``r`` holds, in local order."""
    (a, b), (c, d) = chunk_ranges(seq_len, cp, r)
    return np.concatenate([np.arange(a, b, dtype=np.int64), np.arange(c, d, dtype=np.int64)])


def document_ids(spans: np.ndarray, rows: int, width: int) -> np.ndarray:
    """(rows, width) int64: the document each position is in, numbered in ``spans``' order; -1 at padding.

    ``spans``: (documents, 3) of (row, start, length), as ``data.documents.PackedRows`` gives them. What a CP
    rank's attention compares (``model.context.ContextShard.doc``), taken at its ``local_positions``.
    """
    out = np.full((rows, width), -1, dtype=np.int64)
    for d, (row, start, n) in enumerate(np.asarray(spans, dtype=np.int64).reshape(-1, 3).tolist()):
        out[row, start : start + n] = d
    return out


def attention_shares(spans: np.ndarray, rows: int, width: int, cp: int) -> list[int]:
    """Each CP rank's share of packed rows' attention work, in the units of ``DocumentMask.square_sum``: the sum
    over its ``local_positions`` of ``2 k + 1``, ``k`` the position in its document (0 at padding), what the
    runtime's ``context_rows.attention_square`` counts for a rank's shard. The shares add up to the rows' square
    sum; the largest paces the ring."""
    weight = np.zeros((rows, width), dtype=np.int64)
    for row, start, n in np.asarray(spans, dtype=np.int64).reshape(-1, 3).tolist():
        weight[row, start : start + n] = 2 * np.arange(n, dtype=np.int64) + 1
    return [int(weight[:, local_positions(width, cp, r)].sum()) for r in range(cp)]
