"""Special-token text inside a document is plain text: a document that spells ``<|endoftext|>`` (a text about
tokenizers, a scraped web page) is encoded as those characters, and the only EOS ids in the token stream are the
ones appended between documents. Checked on every path from text to tokens with a tokenizer.json: the cached
text/JSONL source, hetero-tokenize, and a cache written before this rule (re-tokenized, not reused)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from harness import make_bpe_tokenizer
from hetero_llm import layout as layout_mod
from hetero_llm.cli.tokenize import main as tokenize_main
from hetero_llm.data import sources, token_files, tokenizers

pytest.importorskip("tokenizers", reason="the 'test' extra installs tokenizers")

SPECIAL = ("<|endoftext|>", "<pad>")
DOCS = [
    "the cat sat on the mat",
    "a model ends text with <|endoftext|> and pads with <pad>, see",
    "<|endoftext|>",
    "héllo <|endoftext|><|endoftext|> wörld<pad>",
]


def layout_text(data_lines: str) -> str:
    return (
        f"[model]\nlayers = 2\nhidden = 32\nheads = 4\nvocab = 512\nseq_len = 8\n[train]\nsteps = 1\n"
        f'global_batch = 2\n[data]\n{data_lines}\n[cluster]\n[[cluster.nodes]]\nname = "n"\n[[pipelines]]\n'
        'batch = 2\nmicrobatches = 1\n[[pipelines.stages]]\nlayers = 2\ndevices = ["n:0"]\n'
    )


def documents_of(ids: list[int], tok) -> list[str]:
    """The stream cut after each EOS id, each document decoded (the stream must end with an EOS)."""
    ends = [i for i, t in enumerate(ids) if t == tok.eos_id]
    assert ends and ends[-1] == len(ids) - 1, "the stream does not end with an EOS"
    return [tok.decode(ids[a + 1 : b]) for a, b in zip([-1, *ends[:-1]], ends)]


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.delenv("HETERO_LLM_CACHE", raising=False)
    tok_path = make_bpe_tokenizer(tmp_path / "tokenizer.json", DOCS, SPECIAL)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    (tmp_path / "one.txt").write_text(DOCS[1])
    return tmp_path, tokenizers.load(str(tok_path))


def test_special_token_text_in_a_document_is_plain_text(setup):
    tmp_path, tok = setup
    assert tok._tok.token_to_id("<|endoftext|>") == tok.eos_id
    pad = tok._tok.token_to_id("<pad>")
    for doc in DOCS:
        ids = tok.encode(doc)
        assert tok.eos_id not in ids and pad not in ids, doc
        assert tok.decode(ids) == doc
    lay = layout_mod.loads(
        layout_text('kind = "jsonl"\npath = "docs.jsonl"\ntokenizer = "tokenizer.json"'), base_dir=tmp_path
    )
    stream = sources.make_source(lay.data, lay.file).tokens.tolist()
    assert documents_of(stream, tok) == DOCS  # one EOS per document, at its end: none from the text
    lay = layout_mod.loads(
        layout_text('kind = "text"\npath = "one.txt"\ntokenizer = "tokenizer.json"'), base_dir=tmp_path
    )
    assert documents_of(sources.make_source(lay.data, lay.file).tokens.tolist(), tok) == [DOCS[1]]


def test_hetero_tokenize_keeps_special_token_text_plain(setup):
    tmp_path, tok = setup
    out = tmp_path / "train.bin"
    result = CliRunner().invoke(
        tokenize_main, [str(tmp_path / "docs.jsonl"), "-o", str(out), "--tokenizer", str(tmp_path / "tokenizer.json")]
    )
    assert result.exit_code == 0, result.output
    assert documents_of(np.fromfile(out, dtype="<u2").tolist(), tok) == DOCS


def test_a_cache_written_when_special_text_became_special_tokens_is_not_reused(setup):
    """A cache beside the data from before this rule, its sidecar's recipe made as it was then, holds the old
    tokens: it is tokenized again rather than read."""
    import hashlib
    import os

    tmp_path, tok = setup
    source = tmp_path / "docs.jsonl"
    stat = os.stat(source)
    digest = hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest()
    tok._tok.encode_special_tokens = False  # how the text was encoded then
    old = [t for d in DOCS for t in (*tok._tok.encode(d, add_special_tokens=False).ids, tok.eos_id)]
    assert documents_of(old, tok) != DOCS  # then: EOS ids from the text
    cache = Path(token_files.cache_paths(str(source))[0])
    np.array(old, dtype="<u2").tofile(cache)
    cache.with_suffix(".json").write_text(
        json.dumps(
            {
                "recipe": f"{digest}|jsonl|text|{stat.st_size}|{stat.st_mtime_ns}",
                "count": len(old),
                "dtype": "uint16",
                "source": str(source),
            }
        )
    )
    lay = layout_mod.loads(
        layout_text('kind = "jsonl"\npath = "docs.jsonl"\ntokenizer = "tokenizer.json"'), base_dir=tmp_path
    )
    assert (
        documents_of(sources.make_source(lay.data, lay.file).tokens.tolist(), tokenizers.load(lay.data.tokenizer))
        == DOCS
    )
