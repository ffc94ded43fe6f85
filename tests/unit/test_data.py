"""Data sources and batches: determinism, shares, the grammar's loss floor, token caches, bad input."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from hetero_llm.data.batches import GrammarSource, global_batch, pipeline_share
from hetero_llm.data.sources import SourceSpec, make_source
from hetero_llm.data.text_cache import END_OF_DOCUMENT, TokenFileSource, cache_path
from hetero_llm.errors import LayoutError

LAYOUT = "layout.toml"


def data_spec(**overrides) -> SourceSpec:
    """The data layer's spec of ``[data]`` (the layout's DataSpec gives one, ``SourceSpec.of``)."""
    return SourceSpec(**overrides)


@pytest.fixture(scope="module")
def grammar() -> GrammarSource:
    return make_source(data_spec(), LAYOUT)


def raises_layout_error(call, toml_path: str) -> str:
    """Run ``call``, expect a LayoutError at ``toml_path``, and return its full one-line message."""
    with pytest.raises(LayoutError) as info:
        call()
    assert info.value.path == toml_path
    return str(info.value)


def write_bytes(path, content: bytes, mtime_offset_s: float = 0.0) -> str:
    path.write_bytes(content)
    if mtime_offset_s:
        # Filesystem clocks can be coarse: move the source clearly past the cache's mtime.
        stamp = time.time() + mtime_offset_s
        os.utime(path, (stamp, stamp))
    return str(path)


# ---------------------------------------------------------------------------------------------- batches


def test_global_batch_is_a_pure_function_of_seed_and_step(grammar):
    batch = global_batch(grammar, seed=7, step=3, global_batch=8, seq_len=16)
    assert batch.shape == (8, 17) and batch.dtype == np.int64
    # Another process builds its own source from the same layout and must get the same tokens.
    elsewhere = make_source(data_spec(), LAYOUT)
    np.testing.assert_array_equal(batch, global_batch(elsewhere, seed=7, step=3, global_batch=8, seq_len=16))
    assert not np.array_equal(batch, global_batch(grammar, seed=7, step=4, global_batch=8, seq_len=16))
    assert not np.array_equal(batch, global_batch(grammar, seed=8, step=3, global_batch=8, seq_len=16))


def test_pipeline_shares_reassemble_the_global_batch(grammar):
    batch = global_batch(grammar, seed=1, step=0, global_batch=12, seq_len=8)
    # Three pipelines of batch 6, 4, 2 with 3, 2, 1 microbatches.
    shares = [(0, 6, 3), (6, 4, 2), (10, 2, 1)]
    pieces = [piece for offset, size, count in shares for piece in pipeline_share(batch, offset, size, count)]
    assert [piece.shape[0] for piece in pieces] == [2, 2, 2, 2, 2, 2]
    np.testing.assert_array_equal(np.concatenate(pieces), batch)


def test_pipeline_share_rejects_bad_splits(grammar):
    batch = global_batch(grammar, seed=1, step=0, global_batch=12, seq_len=8)
    with pytest.raises(ValueError, match="pipeline batch 6 is not divisible into 4 microbatches"):
        pipeline_share(batch, 0, 6, 4)
    with pytest.raises(ValueError, match=r"rows \[8, 14\) do not fit a global batch of 12"):
        pipeline_share(batch, 8, 6, 2)


# ---------------------------------------------------------------------------------------------- grammar


def test_grammar_stationary_distribution_is_stationary(grammar):
    # Reference: one dense step of the pair chain, (a, b) -> (b, c), must leave it unchanged.
    pairs = grammar.stationary_pairs
    stepped = np.einsum("ab,abc->bc", pairs, grammar.transition_matrix())
    np.testing.assert_allclose(stepped, pairs, rtol=0, atol=1e-12)
    assert pairs.sum() == pytest.approx(1.0)


def test_grammar_loss_floor_matches_empirical_loss_of_true_model(grammar):
    seq_len = 64
    tokens = grammar.sample(np.random.default_rng(11), 2048, seq_len + 1)
    probs = grammar.transition_matrix()
    pairs = grammar.stationary_pairs
    # Target 1 from token 0 alone: p(x1 | x0) = pi(x0, x1) / pi(x0).
    first = np.log(pairs[tokens[:, 0], tokens[:, 1]] / pairs.sum(axis=1)[tokens[:, 0]])
    later = np.log(probs[tokens[:, :-2], tokens[:, 1:-1], tokens[:, 2:]])
    empirical = -(first.sum() + later.sum()) / (tokens.shape[0] * seq_len)
    assert empirical == pytest.approx(grammar.loss_floor(seq_len), rel=0.01)


def test_grammar_first_target_floor_matches_empirical(grammar):
    # seq_len 1 is the first-target term alone: checks the stationary start of sample() too.
    tokens = grammar.sample(np.random.default_rng(12), 20_000, 2)
    pairs = grammar.stationary_pairs
    empirical = -np.log(pairs[tokens[:, 0], tokens[:, 1]] / pairs.sum(axis=1)[tokens[:, 0]]).mean()
    assert empirical == pytest.approx(grammar.loss_floor(1), rel=0.01)
    # Later targets see two tokens, so the floor falls toward the entropy rate as windows grow.
    assert grammar.loss_floor(1) > grammar.loss_floor(64) > grammar.loss_floor(128) > grammar.entropy_rate()


def test_grammar_is_ergodic_and_uses_every_token(grammar):
    probs = grammar.transition_matrix()
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0)
    assert probs.min() > 0  # every pair state reaches every other in two steps
    assert grammar.stationary_pairs.min() > 0
    tokens = grammar.sample(np.random.default_rng(13), 64, 257)
    assert set(np.unique(tokens)) == set(range(64))


def test_grammar_depends_on_its_seed_only():
    same = GrammarSource(16, 3, seed=5), GrammarSource(16, 3, seed=5)
    np.testing.assert_array_equal(same[0].transition_matrix(), same[1].transition_matrix())
    assert not np.array_equal(same[0].transition_matrix(), GrammarSource(16, 3, seed=6).transition_matrix())


# ---------------------------------------------------------------------------------------------- token files


def test_text_file_round_trips_as_bytes(tmp_path):
    content = "The quick brown fox — jumps.\n".encode() * 4
    path = write_bytes(tmp_path / "corpus.txt", content)
    source = make_source(data_spec(kind="text", path=path), LAYOUT)
    assert source.vocab_size == 256
    assert bytes(source.tokens.astype(np.uint8)) == content
    windows = source.sample(np.random.default_rng(0), 16, 10)
    assert windows.dtype == np.int64 and windows.shape == (16, 10)
    for window in windows:
        assert bytes(window.astype(np.uint8)) in content


def test_jsonl_documents_end_with_the_separator(tmp_path):
    lines = ['{"body": "ab", "id": 1}', "", '{"body": "é"}']
    path = write_bytes(tmp_path / "docs.jsonl", "\n".join(lines).encode() + b"\n")
    source = TokenFileSource.from_file(path, "jsonl", field="body")
    expected = b"ab" + bytes([END_OF_DOCUMENT]) + "é".encode() + bytes([END_OF_DOCUMENT])
    assert bytes(source.tokens.astype(np.uint8)) == expected


def test_token_cache_is_reused_then_rebuilt_when_the_source_changes(tmp_path):
    path = write_bytes(tmp_path / "corpus.txt", b"first version of the text")
    TokenFileSource.from_file(path, "text")
    cache = cache_path(path)
    built = os.stat(cache).st_mtime_ns

    again = TokenFileSource.from_file(path, "text")
    assert os.stat(cache).st_mtime_ns == built  # read, not rewritten
    assert bytes(again.tokens.astype(np.uint8)) == b"first version of the text"

    write_bytes(tmp_path / "corpus.txt", b"second version", mtime_offset_s=5)
    changed = TokenFileSource.from_file(path, "text")
    assert bytes(changed.tokens.astype(np.uint8)) == b"second version"
    rebuilt = os.stat(cache).st_mtime_ns
    assert rebuilt != built
    # A source stamped in the future stays fresh once rebuilt (no rebuild on every load).
    TokenFileSource.from_file(path, "text")
    assert os.stat(cache).st_mtime_ns == rebuilt
    # Atomic writes leave only the source and its cache behind.
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt", "corpus.txt.tokens.u16"]


def test_token_cache_is_rebuilt_for_another_jsonl_field(tmp_path):
    path = write_bytes(tmp_path / "docs.jsonl", b'{"text": "xy", "title": "T"}\n')
    assert bytes(TokenFileSource.from_file(path, "jsonl").tokens.astype(np.uint8)) == b"xy\x00"
    by_title = TokenFileSource.from_file(path, "jsonl", field="title")
    assert bytes(by_title.tokens.astype(np.uint8)) == b"T\x00"


# ---------------------------------------------------------------------------------------------- bad input


def test_missing_file_names_the_file(tmp_path):
    missing = str(tmp_path / "nope.txt")
    message = raises_layout_error(lambda: make_source(data_spec(kind="text", path=missing), LAYOUT), "data.path")
    assert message == (
        f"layout.toml: data.path: file '{missing}' does not exist (give an existing .txt or .jsonl file)"
    )


def test_unknown_kind_lists_the_kinds():
    message = raises_layout_error(lambda: make_source(data_spec(kind="csv"), LAYOUT), "data.kind")
    assert (
        message == "layout.toml: data.kind: unknown kind 'csv' (expected one of 'grammar', 'text', 'jsonl', 'tokens')"
    )


def test_bad_jsonl_line_names_the_line_and_writes_no_cache(tmp_path):
    path = write_bytes(tmp_path / "docs.jsonl", b'{"text": "fine"}\n{"text": "cut off"\n')
    message = raises_layout_error(lambda: make_source(data_spec(kind="jsonl", path=path), LAYOUT), "data.path")
    assert message == (
        f"layout.toml: data.path: file '{path}' line 2 is not valid JSON (Expecting ',' delimiter at column 19)"
    )
    assert os.listdir(tmp_path) == ["docs.jsonl"]


@pytest.mark.parametrize(
    "line, problem",
    [
        (b'["text"]', "is a JSON list, expected an object with key 'text'"),
        (b'{"body": "x"}', "has no key 'text' (set data.field to the key holding the text)"),
        (b'{"text": 3}', ": key 'text' holds a int, expected a string"),
    ],
)
def test_jsonl_records_without_text_are_rejected(tmp_path, line, problem):
    path = write_bytes(tmp_path / "docs.jsonl", line + b"\n")
    message = raises_layout_error(lambda: TokenFileSource.from_file(path, "jsonl"), "data.path")
    assert message == f"layout.toml: data.path: file '{path}' line 1 {problem}".replace(" :", ":")


def test_file_too_short_for_one_window_gives_the_numbers(tmp_path):
    path = write_bytes(tmp_path / "tiny.txt", b"0123456789")
    source = make_source(data_spec(kind="text", path=path), LAYOUT)
    message = raises_layout_error(lambda: global_batch(source, seed=0, step=0, global_batch=2, seq_len=10), "data.path")
    assert message == (
        f"layout.toml: data.path: file '{path}' has 10 tokens, fewer than one window of 11 tokens "
        "(seq_len + 1); give a longer file or a smaller seq_len"
    )
    assert global_batch(source, seed=0, step=0, global_batch=2, seq_len=9).shape == (2, 10)


def test_bad_grammar_settings_are_located():
    spec = data_spec(grammar_vocab=8, branching=9)
    message = raises_layout_error(lambda: make_source(spec, LAYOUT), "data.branching")
    assert message == "layout.toml: data.branching: must be between 1 and grammar_vocab (8), got 9"
