"""Context-parallel chunk arithmetic (model/cp_chunks.py) against a brute-force definition over a grid. Torch-free."""

from __future__ import annotations

import numpy as np
import pytest

from hetero_llm.model import cp_chunks


def _brute(seq_len: int, cp: int) -> list[list[int]]:
    """Each position's chunk by walking the row; rank r collects chunks r and 2cp-1-r, in that order."""
    size = seq_len // (2 * cp)
    chunk_of = [p // size for p in range(seq_len)]
    return [
        [p for p in range(seq_len) if chunk_of[p] == r] + [p for p in range(seq_len) if chunk_of[p] == 2 * cp - 1 - r]
        for r in range(cp)
    ]


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("mult", [1, 2, 3, 7])
def test_local_positions_match_brute_force(cp, mult):
    seq_len = 2 * cp * mult
    expected = _brute(seq_len, cp)
    seen = []
    for r in range(cp):
        got = cp_chunks.local_positions(seq_len, cp, r)
        assert got.dtype == np.int64
        assert got.tolist() == expected[r]
        (a, b), (c, d) = cp_chunks.chunk_ranges(seq_len, cp, r)
        assert list(range(a, b)) + list(range(c, d)) == expected[r]
        seen += got.tolist()
    assert sorted(seen) == list(range(seq_len))  # every position on exactly one rank


def test_cp_one_is_the_whole_row_in_order():
    assert cp_chunks.chunk_ranges(8, 1, 0) == ((0, 4), (4, 8))
    assert cp_chunks.local_positions(8, 1, 0).tolist() == list(range(8))


def test_causal_work_is_balanced():
    """Causal attention pairs (query, key<=query) per rank are equal on every rank: the reason for the zigzag."""
    for cp in (2, 3, 4):
        seq_len = 2 * cp * 3
        work = {int((cp_chunks.local_positions(seq_len, cp, r) + 1).sum()) for r in range(cp)}
        assert len(work) == 1


@pytest.mark.parametrize(
    ("seq_len", "cp", "ok"), [(12, 3, True), (10, 2, False), (16, 4, True), (8, 3, False), (4, 0, False)]
)
def test_divisible(seq_len, cp, ok):
    assert cp_chunks.divisible(seq_len, cp) is ok


def test_bad_rank_or_length_is_refused():
    with pytest.raises(ValueError, match="multiple of 2\\*cp = 6"):
        cp_chunks.chunk_ranges(8, 3, 0)
    with pytest.raises(ValueError):
        cp_chunks.chunk_ranges(8, 2, 2)


def test_document_ids():
    spans = np.array([[0, 0, 3], [0, 3, 5], [1, 0, 2], [1, 4, 3]])  # row 1: padding at 2, 3 and 7
    got = cp_chunks.document_ids(spans, 2, 8)
    assert got.dtype == np.int64
    assert got.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [2, 2, -1, -1, 3, 3, 3, -1]]
    assert cp_chunks.document_ids(np.zeros((0, 3)), 1, 4).tolist() == [[-1] * 4]


def test_attention_shares_add_up_to_the_rows_square_sum_and_follow_each_ranks_positions():
    """A CP rank's share of packed rows' attention (switching/predict.py prices the slowest one): ``2 k + 1`` at each
    of its positions, ``k`` the position in its document, 0 at padding. Two rows of 16: a row of documents 10 and 6,
    a row of one document of 5 then padding."""
    spans = np.array([[0, 0, 10], [0, 10, 6], [1, 0, 5]])
    shares = cp_chunks.attention_shares(spans, 2, 16, 2)
    assert sum(shares) == 10**2 + 6**2 + 5**2 == 161
    in_doc = np.zeros((2, 16), dtype=np.int64)
    in_doc[0, :10], in_doc[0, 10:], in_doc[1, :5] = 2 * np.arange(10) + 1, 2 * np.arange(6) + 1, 2 * np.arange(5) + 1
    assert shares == [int(in_doc[:, cp_chunks.local_positions(16, 2, r)].sum()) for r in range(2)]
    # rank 0 holds positions 0-3 and 12-15, rank 1 4-11: the long first document's late tokens are rank 1's
    assert shares == [1 + 3 + 5 + 7 + 5 + 7 + 9 + 11 + 1 + 3 + 5 + 7, 161 - 64] == [64, 97]
    assert cp_chunks.attention_shares(spans, 2, 16, 1) == [161]
