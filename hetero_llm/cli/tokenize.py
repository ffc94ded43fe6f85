"""``hetero-tokenize``: a text or JSONL file into a token file (data/token_files.py)."""

from __future__ import annotations

import os
import sys

import click

from hetero_llm.cli.common import OneLineCommand
from hetero_llm.data import tokenizers as tokens
from hetero_llm.data.token_files import tokenize_file
from hetero_llm.errors import LayoutError
from hetero_llm.launch import preflight


def _progress_bar():
    try:
        from tqdm import tqdm
    except ImportError:  # no bar without tqdm (the 'hf' extra installs it)
        return None, lambda: None
    bar = tqdm(unit="tok", unit_scale=True, desc="tokens", file=sys.stderr, disable=not sys.stderr.isatty())
    return bar.update, bar.close


@click.command("hetero-tokenize", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("source", metavar="INPUT", type=click.Path(dir_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False),
              help="Token file to write: .bin (raw, as nanoGPT) or .npy.")
@click.option("--tokenizer", default=tokens.BYTES, show_default=True,
              help="'bytes' or a local Hugging Face tokenizer.json.")
@click.option("--kind", type=click.Choice(["text", "jsonl"]), default=None,
              help="Input format (default: jsonl for .jsonl files, else text).")
@click.option("--field", default="text", show_default=True, help="JSONL key holding each document's text.")
def main(source, out, tokenizer, kind, field):
    """Tokenize a text or JSONL file into a token file for [data] kind = 'tokens'."""
    kind = kind or ("jsonl" if source.endswith(".jsonl") else "text")
    try:
        if not os.path.isfile(source):
            raise LayoutError(source, "INPUT", "no such file (give a .txt or .jsonl file)")
        if not out.endswith((".bin", ".npy")):
            raise LayoutError(out, "--out", "must end in .bin or .npy")
        inputs = [("the input file", source)] + ([("--tokenizer", tokenizer)] if tokenizer != tokens.BYTES else [])
        preflight.check_output_file("--out", out, inputs)
        try:
            tokens.load(tokenizer)
        except ValueError as e:
            raise LayoutError(tokenizer, "--tokenizer", str(e)) from None
        update, close = _progress_bar()
        try:
            count, dtype = tokenize_file(source, out, kind, field, tokenizer, source, update)
        finally:
            close()
    except LayoutError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    dtype_line = "" if dtype == "uint16" or out.endswith(".npy") else f", token_dtype = '{dtype}'"
    click.echo(f"wrote {count} tokens ({dtype}) to {out}: train on it with [data] kind = 'tokens', "
               f"path = '{out}'{dtype_line}")
