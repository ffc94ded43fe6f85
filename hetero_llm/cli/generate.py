"""``hetero-generate``: sample a continuation from a checkpoint (interop/generate.py)."""

from __future__ import annotations

import re

import click
import torch

from hetero_llm.cli.common import FiniteFloatRange, OneLineCommand, WholeRange, one_line_errors, version_option
from hetero_llm.errors import LayoutError
from hetero_llm.interop.generate import generate
from hetero_llm.layout import DataKind
from hetero_llm.progress import Bar

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
DEFAULT_NEW_TOKENS = 64


class _Device(click.ParamType):
    """``--device``: 'cpu', or 'cuda[:N]' of a GPU this machine has; anything else is a one-line usage error."""

    name = "device"

    def convert(self, value, param, ctx):
        text = str(value).strip()
        found = re.fullmatch(r"cpu|cuda(?::(0|[1-9][0-9]*))?", text)
        if found is None:
            self.fail(f"'{value}' is not a device this command runs on (give 'cpu' or 'cuda:N')", param, ctx)
        if text != "cpu":
            if not torch.cuda.is_available():
                self.fail(f"'{value}' needs CUDA, which this machine does not have (use --device cpu)", param, ctx)
            count, index = torch.cuda.device_count(), int(found.group(1) or 0)
            if index >= count:
                self.fail(
                    f"'{value}' is not one of this machine's {count} GPU(s) (use cuda:0 to cuda:{count - 1})",
                    param,
                    ctx,
                )
        return text


@click.command("hetero-generate", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@version_option("hetero-generate")
@click.argument("checkpoint_dir", metavar="CHECKPOINT_DIR", type=click.Path())
@click.option("--prompt", required=True, help="Text the model continues.")
@click.option(
    "--max-new-tokens",
    type=WholeRange(min=1),
    default=None,
    show_default="64, or what fits",
    help="Tokens to generate at most (fewer after an EOS); the prompt and them must fit in model.seq_len. "
    "Default: 64, or as many as fit after the prompt.",
)
@click.option(
    "--temperature",
    type=FiniteFloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Softmax temperature; 0 = greedy (the likeliest token each time).",
)
@click.option(
    "--top-k",
    type=WholeRange(min=0),
    default=0,
    show_default=True,
    help="Sample among the K likeliest tokens only (0: all; at most model.vocab).",
)
@click.option(
    "--seed", type=WholeRange(0, MAX_SEED), default=0, show_default=True, help="Seed of the sampling (0 to 2**64 - 1)."
)
@click.option("--device", type=_Device(), default="cpu", show_default=True, help="Where to run: 'cpu' or 'cuda:N'.")
def main(checkpoint_dir, prompt, max_new_tokens, temperature, top_k, seed, device):
    """Continue --prompt with the model a checkpoint holds (prints the prompt and its continuation)."""
    from hetero_llm.checkpoint.shards import load_full_params
    from hetero_llm.interop import export

    with one_line_errors(describe=export.reader_error):
        s = export.saved(checkpoint_dir)
        tok = export.load_tokenizer(s.data, str(s.ckpt.path))
        grammar = s.data.kind is DataKind.GRAMMAR  # its tokens are ids, not text
        ids = _ids(prompt, str(s.ckpt.path)) if grammar else tok.encode(prompt)
        if not ids:
            raise LayoutError(str(s.ckpt.path), "--prompt", "is empty (give some text to continue)")
        if max(ids) >= s.model.vocab or min(ids) < 0:
            raise LayoutError(
                str(s.ckpt.path),
                "--prompt",
                f"token {max(ids)} is outside the model's vocabulary of {s.model.vocab} (model.vocab)",
            )
        room = s.model.seq_len - len(ids)
        if room < 1:
            raise LayoutError(
                str(s.ckpt.path),
                "--prompt",
                f"{len(ids)} tokens leave no room for new ones in "
                f"model.seq_len {s.model.seq_len}, the positions the model was trained on (give at most "
                f"{s.model.seq_len - 1} tokens)",
            )
        if max_new_tokens is None:  # the default: as many as fit, up to 64
            max_new_tokens = min(DEFAULT_NEW_TOKENS, room)
        if max_new_tokens > room:
            raise LayoutError(
                str(s.ckpt.path),
                "--max-new-tokens",
                f"{max_new_tokens} tokens after a prompt of "
                f"{len(ids)} exceed model.seq_len {s.model.seq_len}, the positions the model was trained "
                f"on (use at most {max(room, 0)}, or a shorter prompt)",
            )
        if top_k > s.model.vocab:
            raise LayoutError(
                str(s.ckpt.path),
                "--top-k",
                f"{top_k} is more than the model's {s.model.vocab} tokens "
                f"(model.vocab; use at most {s.model.vocab}, or 0 for all)",
            )
        warning = export.verify(s)  # as --resume verifies a save, with the same words
        if warning:
            click.echo(f"warning: {warning}", err=True)
        params = {n: t.to(device) for n, t in load_full_params(str(s.ckpt.path), progress=True).items()}
    with Bar("generating", max_new_tokens, "tok") as bar:  # on a terminal only (stderr)
        new = generate(
            params, s.model, ids, max_new_tokens, temperature, top_k, seed, None if grammar else tok.eos_id, bar.update
        )
    if grammar:
        click.echo(" ".join(map(str, ids + new)))
        return
    click.echo(tok.decode(ids + [t for t in new if t != tok.eos_id]))  # the EOS ends the text, unprinted


def _ids(prompt: str, where: str) -> list[int]:
    try:
        return [int(t) for t in prompt.split()]
    except ValueError:
        raise LayoutError(
            where,
            "--prompt",
            "the model was trained on the embedded grammar, whose tokens are ids, "
            "not text: give ids separated by spaces, e.g. --prompt '3 17 5'",
        ) from None


if __name__ == "__main__":
    main()
