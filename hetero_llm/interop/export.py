"""``hetero-export CHECKPOINT_DIR --hf OUT_DIR``: a checkpoint of any layout as a Hugging Face model directory.

The checkpoint's meta.json records the [model] and [data] it was trained with; the full parameters are
assembled from the rank files (any layout), mapped to Llama or GPT-2 names (hf_names, hf) and written as
``config.json`` + ``model.safetensors``, with the tokenizer.json when the run used one.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from hetero_llm.checkpoint import folders
from hetero_llm.data import tokenizers
from hetero_llm.errors import CheckpointError, LayoutError
from hetero_llm.interop import hf, hf_config
from hetero_llm.layout import DataSpec, ModelSpec, build, model_from_dict

WHERE = "CHECKPOINT_DIR"


@attrs.frozen
class Saved:
    """What a checkpoint was trained as: its folder, [model] and [data]."""

    ckpt: folders.Checkpoint
    model: ModelSpec
    data: DataSpec


def reader_error(e: LayoutError) -> LayoutError:
    """An error ``--resume`` would give about this save (checkpoint/folders.py, checkpoint/shards.py: the same checks and words),
    located at CHECKPOINT_DIR and without its advice to resume otherwise; any other error as it is."""
    if not isinstance(e, CheckpointError) or e.path != "--resume":
        return e
    message = e.message.replace(folders.DAMAGED, "pass another step folder")
    message = message.replace(", or start without --resume", "").replace("resuming without", "reading it without")
    return CheckpointError(e.file, WHERE, message)


def verify(s: Saved) -> str | None:
    """``folders.verify``, as ``--resume`` runs it before any rank starts: every rank file's size and sha256
    against meta.json's records. Raises the error resume gives (``reader_error``); returns its warning for a save
    without records."""
    try:
        warning = folders.verify(s.ckpt)
    except CheckpointError as e:
        raise reader_error(e) from None
    return (
        None
        if warning is None
        else f"{s.ckpt.path}: {WHERE}: {folders.UNVERIFIED}".replace("resuming without", "reading it without")
    )


def saved(directory: str) -> Saved:
    """The complete save ``directory`` names (a step folder or a checkpoint root) and its [model] and [data]."""
    try:
        ckpt = folders.find(directory)
    except CheckpointError as e:
        raise reader_error(e) from None
    meta = json.loads((ckpt.path / folders.META).read_text())
    if "model" not in meta:
        raise CheckpointError(
            str(ckpt.path),
            WHERE,
            f"{folders.META} records no [model] (saved by an older "
            "version): resume it for one step with --checkpoint to save it again",
        )
    file = str(ckpt.path / folders.META)
    return Saved(ckpt, model_from_dict(meta["model"], file), build(DataSpec, meta.get("data", {}), "data", file))


def tokenizer_files(tok: tokenizers.ByteTokenizer | tokenizers.HFTokenizer) -> dict[str, bytes]:
    """tokenizer.json and a tokenizer_config.json naming its EOS, for ``AutoTokenizer``; none for bytes."""
    if isinstance(tok, tokenizers.ByteTokenizer):
        return {}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token}
    return {
        "tokenizer.json": Path(tok.name).read_bytes(),
        "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode(),
    }


def load_tokenizer(data: DataSpec, where: str) -> tokenizers.ByteTokenizer | tokenizers.HFTokenizer:
    try:
        return tokenizers.load(data.tokenizer)
    except ValueError as e:
        raise LayoutError(where, "data.tokenizer", str(e)) from None


def input_paths(s: Saved, directory: str) -> list[tuple[str, str]]:
    """What an export reads (``hetero-export`` never writes into them): the checkpoint, the save, the tokenizer."""
    inputs = [(WHERE, directory), ("the save", str(s.ckpt.path))]
    if s.data.tokenizer != tokenizers.BYTES:
        inputs.append(("data.tokenizer", s.data.tokenizer))
    return inputs


def export_checkpoint(
    directory: str, out_dir: str, warn=lambda line: None, s: Saved | None = None, progress: bool = False
) -> Path:
    """Write the model ``directory`` holds (its save ``s``, when already read) into ``out_dir`` as a Hugging Face
    model; return ``out_dir``. The save is verified as ``--resume`` verifies it (``warn`` gets the warning of a
    save without records). ``progress``: show the reading of the checkpoint on a terminal (``progress.Bar``)."""
    from hetero_llm.checkpoint.shards import load_full_params

    s = s or saved(directory)
    hf_config.check_export(s.model, str(s.ckpt.path), WHERE)
    tok = load_tokenizer(s.data, str(s.ckpt.path))
    warning = verify(s)
    if warning:
        warn(warning)
    try:
        params = load_full_params(str(s.ckpt.path), progress)
    except CheckpointError as e:
        raise reader_error(e) from None
    return hf.export(params, s.model, out_dir, eos_token_id=tok.eos_id, extra_files=tokenizer_files(tok))
