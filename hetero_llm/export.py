"""``hetero-export CHECKPOINT_DIR --hf OUT_DIR``: a checkpoint of any layout as a Hugging Face model directory.

The checkpoint's meta.json records the [model] and [data] it was trained with; the full parameters are
assembled from the rank files (any layout), mapped to Llama or GPT-2 names (hf.py) and written as
``config.json`` + ``model.safetensors``, with the tokenizer.json when the run used one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import attrs
import click

from hetero_llm import checkpoint, hf, tokens
from hetero_llm.cli import OneLineCommand, version_option
from hetero_llm.errors import CheckpointError, LayoutError
from hetero_llm.layout import DataSpec, ModelSpec, build, model_from_dict

WHERE = "CHECKPOINT_DIR"


@attrs.frozen
class Saved:
    """What a checkpoint was trained as: its folder, [model] and [data]."""

    ckpt: checkpoint.Checkpoint
    model: ModelSpec
    data: DataSpec


def saved(directory: str) -> Saved:
    """The complete save ``directory`` names (a step folder or a checkpoint root) and its [model] and [data]."""
    try:
        ckpt = checkpoint.find(directory)
    except CheckpointError as e:
        raise CheckpointError(e.file, WHERE, e.message.replace(", or start without --resume", "")) from None
    meta = json.loads((ckpt.path / checkpoint.META).read_text())
    if "model" not in meta:
        raise CheckpointError(str(ckpt.path), WHERE, f"{checkpoint.META} records no [model] (saved by an older "
                              "version): resume it for one step with --checkpoint to save it again")
    file = str(ckpt.path / checkpoint.META)
    return Saved(ckpt, model_from_dict(meta["model"], file), build(DataSpec, meta.get("data", {}), "data", file))


def tokenizer_files(tok: tokens.ByteTokenizer | tokens.HFTokenizer) -> dict[str, bytes]:
    """tokenizer.json and a tokenizer_config.json naming its EOS, for ``AutoTokenizer``; none for bytes."""
    if isinstance(tok, tokens.ByteTokenizer):
        return {}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token}
    return {"tokenizer.json": Path(tok.name).read_bytes(),
            "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode()}


def load_tokenizer(data: DataSpec, where: str) -> tokens.ByteTokenizer | tokens.HFTokenizer:
    try:
        return tokens.load(data.tokenizer)
    except ValueError as e:
        raise LayoutError(where, "data.tokenizer", str(e)) from None


def export_checkpoint(directory: str, out_dir: str) -> Path:
    """Write the model ``directory`` holds into ``out_dir`` as a Hugging Face model; return ``out_dir``."""
    from hetero_llm.checkpoint_io import load_full_params

    s = saved(directory)
    hf.check_export(s.model, str(s.ckpt.path), WHERE)
    tok = load_tokenizer(s.data, str(s.ckpt.path))
    params = load_full_params(str(s.ckpt.path))
    return hf.export(params, s.model, out_dir, eos_token_id=tok.eos_id, extra_files=tokenizer_files(tok))


@click.command("hetero-export", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@version_option("hetero-export")
@click.argument("checkpoint_dir", metavar="CHECKPOINT_DIR", type=click.Path())
@click.option("--hf", "out", required=True, type=click.Path(file_okay=False), metavar="OUT_DIR",
              help="Write config.json + model.safetensors here (transformers loads it as LlamaForCausalLM or "
                   "GPT2LMHeadModel).")
def main(checkpoint_dir, out):
    """Export a checkpoint (a --checkpoint DIR or one of its step folders) as a Hugging Face model."""
    try:
        path = export_checkpoint(checkpoint_dir, out)
    except LayoutError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(f"wrote {path}: load it with transformers.AutoModelForCausalLM.from_pretrained('{path}')")


if __name__ == "__main__":
    main()
