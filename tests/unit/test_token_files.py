"""Tokenizers and token files: hetero-tokenize writes .bin/.npy files, data.kind = 'tokens' trains on them,
text through a local tokenizer.json is cached once, and every document ends with the tokenizer's EOS."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers_text import DOCS, make_tokenizer, write_jsonl

from harness import assert_one_error_line, invoke_cli
from hetero_llm import layout as layout_mod
from hetero_llm.cli.tokenize import main as tokenize_main
from hetero_llm.data import batches, sources, token_files, tokenizers
from hetero_llm.errors import LayoutError

pytest.importorskip("tokenizers", reason="the 'test' extra installs tokenizers")


def tokenize(*args):
    """hetero-tokenize ARGS in this process, stdout and stderr apart (its summary line goes to stderr)."""
    # click < 8.2 mixes stderr into output unless told not to; 8.2 removed the flag and always separates
    separate = {"mix_stderr": False} if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters else {}
    return CliRunner(**separate).invoke(tokenize_main, [str(a) for a in args])


def test_hetero_tokenize_bytes_bin_is_nanogpt_layout(tmp_path):
    out = tmp_path / "train.bin"
    result = tokenize(write_jsonl(tmp_path / "docs.jsonl"), "-o", out)
    assert result.exit_code == 0, result.output
    want = [t for d in DOCS for t in (*d.encode(), tokenizers.BYTE_EOS)]
    assert np.fromfile(out, dtype="<u2").tolist() == want  # raw little-endian uint16, EOS after each document
    assert result.stdout == (
        f"wrote {len(want)} tokens (uint16) to {out}: train on it with [data] kind = 'tokens', path = '{out}'\n"
    )
    assert result.stderr.startswith(
        f"tokenized {out.with_name('docs.jsonl').stat().st_size} B into {len(want)} tokens in "
    )


def test_hetero_tokenize_with_a_tokenizer_to_npy(tmp_path):
    tok_path = make_tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "train.npy"
    assert tokenize(write_jsonl(tmp_path / "docs.jsonl"), "-o", out, "--tokenizer", tok_path).exit_code == 0
    tok = tokenizers.load(str(tok_path))
    assert tok.eos_id == tok._tok.token_to_id("<|endoftext|>")
    want = [t for d in DOCS for t in (*tok.encode(d), tok.eos_id)]
    got = np.load(out)
    assert got.dtype == np.uint16 and got.tolist() == want
    assert tok.decode(tok.encode(DOCS[2])) == DOCS[2]


@pytest.mark.parametrize(
    "args,expected",
    [
        (["missing.txt", "-o", "x.bin"], "missing.txt: INPUT: no such file (give a .txt or .jsonl file)"),
        (["{src}", "-o", "x.txt"], "x.txt: --out: must end in .bin or .npy"),
        (
            ["{src}", "-o", "x.bin", "--tokenizer", "nope.json"],
            "nope.json: --tokenizer: file 'nope.json' does not exist (give 'bytes' or a local Hugging Face tokenizer.json)",
        ),
    ],
)
def test_hetero_tokenize_bad_input(args, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src.txt").write_text("hello")
    result = tokenize(*[a.replace("{src}", "src.txt") for a in args])
    assert result.exit_code == 2 and (result.stdout, result.stderr) == ("", f"error: {expected}\n")


def layout_text(data_lines: str, vocab: int = 512) -> str:
    return (
        f"[model]\nlayers = 2\nhidden = 32\nheads = 4\nvocab = {vocab}\nseq_len = 8\n[train]\nsteps = 1\n"
        f'global_batch = 2\n[data]\n{data_lines}\n[cluster]\n[[cluster.nodes]]\nname = "n"\n[[pipelines]]\n'
        'batch = 2\nmicrobatches = 1\n[[pipelines.stages]]\nlayers = 2\ndevices = ["n:0"]\n'
    )


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows(dtype, tmp_path):
    ids = (np.arange(1000) * 7 % 70000 if dtype == "uint32" else np.arange(1000) % 500).astype(dtype)
    ids.tofile(tmp_path / "t.bin")
    lay = layout_mod.loads(
        layout_text(f'kind = "tokens"\npath = "t.bin"\ntoken_dtype = "{dtype}"', vocab=70000), base_dir=tmp_path
    )
    source = sources.make_source(lay.data, lay.file)
    assert source.vocab_size == int(ids.max()) + 1
    batch = batches.global_batch(source, seed=0, step=3, global_batch=4, seq_len=8)
    for row in batch:  # every window is a run of consecutive file tokens
        start = int(np.flatnonzero(ids == row[0])[0])
        assert row.tolist() == ids[start : start + 9].tolist()


def test_token_ids_above_the_vocab_are_refused_before_training(tmp_path):
    (np.arange(600) % 300).astype("<u2").tofile(tmp_path / "t.bin")
    path = tmp_path / "layout.toml"
    path.write_text(layout_text('kind = "tokens"\npath = "t.bin"', vocab=256))
    assert_one_error_line(
        invoke_cli(path),
        f"{path}: model.vocab: 256 is too small for '{tmp_path / 't.bin'}', whose "
        "token ids go up to 299 (set model.vocab >= 300)",
    )


@pytest.mark.parametrize(
    "name,content,expected",
    [
        (
            "t.txt",
            b"ab",
            "data.path: file '{f}' is neither .bin nor .npy (data.kind 'tokens' reads token files; use kind "
            "'text' or 'jsonl' for text)",
        ),
        ("t.bin", b"abc", None),
        ("t.npy", b"not numpy", None),
    ],
)
def test_bad_token_files(name, content, expected, tmp_path):
    (tmp_path / name).write_bytes(content)
    f = tmp_path / name
    text = layout_text(f'kind = "tokens"\npath = "{name}"')
    with pytest.raises(LayoutError) as info:
        lay = layout_mod.loads(text, base_dir=tmp_path)
        sources.make_source(lay.data, lay.file)
    if expected:
        assert str(info.value) == "<string>: " + expected.format(f=f)
    elif name.endswith(".bin"):
        assert str(info.value) == (
            f"<string>: data.path: file '{f}' has 3 bytes, not a whole number of uint16 tokens (check data.token_dtype)"
        )
    else:
        assert str(info.value).startswith(f"<string>: data.path: file '{f}' is not a NumPy .npy file (")


def test_text_through_a_tokenizer_is_cached_once(tmp_path, monkeypatch):
    monkeypatch.delenv("HETERO_LLM_CACHE", raising=False)
    tok_path = make_tokenizer(tmp_path / "tokenizer.json")
    write_jsonl(tmp_path / "docs.jsonl")
    lay = layout_mod.loads(
        layout_text('kind = "jsonl"\npath = "docs.jsonl"\ntokenizer = "tokenizer.json"'), base_dir=tmp_path
    )
    source = sources.make_source(lay.data, lay.file)
    tok = tokenizers.load(str(tok_path))
    assert source.tokens.tolist() == [t for d in DOCS for t in (*tok.encode(d), tok.eos_id)]
    cache = tmp_path / "docs.jsonl.hf-tokens.bin"
    assert cache.exists() and cache.with_suffix(".json").exists()
    monkeypatch.setattr(token_files, "tokenize_file", lambda *a, **k: pytest.fail("tokenized again"))
    assert sources.make_source(lay.data, lay.file).tokens.tolist() == source.tokens.tolist()


def test_read_only_data_folder_caches_in_the_user_cache(tmp_path, monkeypatch):
    """Root ignores file modes, so the data folder's refusal is simulated where the cache is written."""
    make_tokenizer(tmp_path / "tokenizer.json")
    write_jsonl(tmp_path / "docs.jsonl")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    monkeypatch.delenv("HETERO_LLM_CACHE", raising=False)
    write = token_files.write_tokens

    def refuse_beside_source(out, *args, **kwargs):
        if Path(out).parent == tmp_path:
            raise PermissionError(13, "Permission denied", out)
        return write(out, *args, **kwargs)

    monkeypatch.setattr(token_files, "write_tokens", refuse_beside_source)
    lay = layout_mod.loads(
        layout_text('kind = "jsonl"\npath = "docs.jsonl"\ntokenizer = "tokenizer.json"'), base_dir=tmp_path
    )
    source = sources.make_source(lay.data, lay.file)
    assert Path(source.path).parent == tmp_path / "user-cache" / "hetero_llm"
    assert not (tmp_path / "docs.jsonl.hf-tokens.bin").exists()


def test_hetero_llm_cache_names_the_cache_folder(tmp_path, monkeypatch):
    make_tokenizer(tmp_path / "tokenizer.json")
    write_jsonl(tmp_path / "docs.jsonl")
    monkeypatch.setenv("HETERO_LLM_CACHE", str(tmp_path / "chosen"))
    lay = layout_mod.loads(
        layout_text('kind = "jsonl"\npath = "docs.jsonl"\ntokenizer = "tokenizer.json"'), base_dir=tmp_path
    )
    assert Path(sources.make_source(lay.data, lay.file).path).parent == tmp_path / "chosen"
    assert not (tmp_path / "docs.jsonl.hf-tokens.bin").exists()
