"""``hetero-tokenize``: a text or JSONL file into a token file (data/token_files.py)."""

from __future__ import annotations

import os

import click

from hetero_llm.cli.common import OneLineCommand, one_line_errors, version_option
from hetero_llm.data import tokenizers
from hetero_llm.data.token_files import tokenize_file
from hetero_llm.errors import LayoutError
from hetero_llm.launch import outputs
from hetero_llm.progress import Bar, amount, clock


class _TokenizeProgress:
    """hetero-tokenize's bar: the bytes of the input tokenized so far of its size, with an ETA, and the tokens
    written (redrawn as each batch of documents is written: the bytes read run ahead of them by at most a batch);
    then one summary line on stderr, terminal or not."""

    def __init__(self, source: str):
        self.bar = Bar(f"tokenizing {source}", os.path.getsize(source), "B")
        self.read_ahead = 0  # bytes read whose documents are not written yet
        self.tokens = 0

    def read(self, n: int) -> None:
        self.read_ahead += n

    def written(self, n: int) -> None:
        self.tokens += n
        self.bar.update(self.read_ahead, note=amount(self.tokens, "tokens"))
        self.read_ahead = 0

    def close(self, done: bool) -> None:
        bar = self.bar
        bar.done += self.read_ahead
        summary = (
            (
                f"tokenized {amount(bar.done, 'B')} into {self.tokens} tokens in {clock(bar.elapsed)} "
                f"({amount(self.tokens / max(bar.elapsed, 1e-9), 'tokens')}/s)"
            )
            if done
            else None
        )
        bar.close(summary)


@click.command("hetero-tokenize", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@version_option("hetero-tokenize")
@click.argument("source", metavar="INPUT", type=click.Path(dir_okay=False))
@click.option(
    "-o",
    "--out",
    required=True,
    type=click.Path(dir_okay=False),
    help="Token file to write: .bin (raw, as nanoGPT) or .npy.",
)
@click.option(
    "--tokenizer", default=tokenizers.BYTES, show_default=True, help="'bytes' or a local Hugging Face tokenizer.json."
)
@click.option(
    "--kind",
    type=click.Choice(["text", "jsonl"]),
    default=None,
    help="Input format (default: jsonl for .jsonl files, else text).",
)
@click.option("--field", default="text", show_default=True, help="JSONL key holding each document's text.")
def main(source, out, tokenizer, kind, field):
    """Tokenize a text or JSONL file into a token file for [data] kind = 'tokens'."""
    kind = kind or ("jsonl" if source.endswith(".jsonl") else "text")
    with one_line_errors():
        if not os.path.isfile(source):
            raise LayoutError(source, "INPUT", "no such file (give a .txt or .jsonl file)")
        if not out.endswith((".bin", ".npy")):
            raise LayoutError(out, "--out", "must end in .bin or .npy")
        inputs = [("the input file", source)] + ([("--tokenizer", tokenizer)] if tokenizer != tokenizers.BYTES else [])
        outputs.check_output_file("--out", out, inputs)
        try:
            tokenizers.load(tokenizer)
        except ValueError as e:
            raise LayoutError(tokenizer, "--tokenizer", str(e)) from None
        progress, done = _TokenizeProgress(source), False
        try:
            count, dtype = tokenize_file(source, out, kind, field, tokenizer, source, progress.written, progress.read)
            done = True
        finally:
            progress.close(done)
    dtype_line = "" if dtype == "uint16" or out.endswith(".npy") else f", token_dtype = '{dtype}'"
    click.echo(
        f"wrote {count} tokens ({dtype}) to {out}: train on it with [data] kind = 'tokens', path = '{out}'{dtype_line}"
    )


if __name__ == "__main__":
    main()
