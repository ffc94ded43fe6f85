"""``hetero-export``: a checkpoint as a Hugging Face model (interop/export.py)."""

from __future__ import annotations

import click

from hetero_llm.cli.common import OneLineCommand, one_line_errors, version_option
from hetero_llm.interop import export
from hetero_llm.launch import outputs


@click.command("hetero-export", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@version_option("hetero-export")
@click.argument("checkpoint_dir", metavar="CHECKPOINT_DIR", type=click.Path())
@click.option(
    "--hf",
    "out",
    required=True,
    type=click.Path(file_okay=False),
    metavar="OUT_DIR",
    help="Write config.json + model.safetensors here (transformers loads it as LlamaForCausalLM or GPT2LMHeadModel).",
)
def main(checkpoint_dir, out):
    """Export a checkpoint (a --checkpoint DIR or one of its step folders) as a Hugging Face model."""
    with one_line_errors():
        s = export.saved(checkpoint_dir)
        # never into the checkpoint, nor over the tokenizer
        outputs.check_output_folder("--hf", out, export.input_paths(s, checkpoint_dir))
        path = export.export_checkpoint(
            checkpoint_dir, out, lambda line: click.echo(f"warning: {line}", err=True), s, progress=True
        )
    click.echo(f"wrote {path}: load it with transformers.AutoModelForCausalLM.from_pretrained('{path}')")


if __name__ == "__main__":
    main()
