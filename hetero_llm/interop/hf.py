"""Hugging Face interop: our parameters as ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` weights and back.

A model leaves as a directory ``transformers`` loads (``config.json`` + ``model.safetensors``), and a layout
can start from one (``[model] init_from``), each rank reading only the slices it holds.

What differs between the two sides, and how the mapping handles it:

- RoPE. We rotate neighbouring pairs (2j, 2j + 1) of each head; HF Llama rotates halves (j, j + head/2),
  both by the angle of frequency j. So HF's row j of a head is our row 2j and HF's row j + head/2 our row
  2j + 1: each head's rows of the query and key weights (and biases) are permuted, as HF's own conversion
  script does. Attention scores are unchanged because queries and keys are permuted alike.
- GPT-2 keeps Q, K and V in one ``c_attn`` and stores every projection as ``Conv1D``: (in, out), the
  transpose of ours; its position embedding may be longer than ``model.seq_len`` (we keep the first rows).
- Names: ``gate_proj``/``up_proj``/``down_proj`` are our ``w1``/``w3``/``w2`` (silu(w1 x) * w3 x).

The names and shapes of the mapping are ``hf_names``; ``config.json`` both ways, and the checks of a model
directory before a run, are ``hf_config``; here, the weights out and in. Torch-free at import (the launcher's
preflight reads every weight with ``check_weights``); torch and safetensors load on use.
"""

from __future__ import annotations

import json
import math
import os
from operator import methodcaller
from pathlib import Path
from typing import Any

import attrs

from hetero_llm._fs import write_atomically
from hetero_llm.errors import LayoutError
from hetero_llm.interop.hf_config import hf_config
from hetero_llm.interop.hf_names import CONFIG, WEIGHTS, WEIGHTS_INDEX, Source, gpt2_key, hf_shapes, weight_sources
from hetero_llm.layout import Layout, ModelSpec
from hetero_llm.model.params import all_params


def _to_ours_order(rows, heads: int):
    """HF rows (heads * hd, ...) in half-split order -> our pair order, per head."""
    hd = rows.shape[0] // heads
    rest = rows.shape[1:]
    return rows.reshape(heads, 2, hd // 2, *rest).transpose(1, 2).reshape(heads * hd, *rest)


def _to_hf_order(rows, heads: int):
    """Our rows (heads * hd, ...) in pair order -> HF's half-split order, per head."""
    hd = rows.shape[0] // heads
    rest = rows.shape[1:]
    return rows.reshape(heads, hd // 2, 2, *rest).transpose(1, 2).reshape(heads * hd, *rest)


# ------------------------------------------------------------------------------------------
# Export: full parameters -> a directory transformers loads


def export(
    params: dict,
    model: ModelSpec,
    out_dir: str | os.PathLike,
    eos_token_id: int | None = None,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` of the full parameters ``params`` into ``out_dir``.

    Every file is written to a temporary name and renamed, so a crash leaves no half-written model file.
    """
    import torch
    from safetensors.torch import save

    shapes = {info.name: info.shape for info in all_params(attrs.evolve(model, bias=True))}
    tensors: dict[str, torch.Tensor] = {}
    for name, src in weight_sources(model).items():
        t = params[name].detach().float().cpu() if name in params else torch.zeros(shapes[name])  # GPT-2 biases
        if src.rope_heads:
            t = _to_hf_order(t, src.rope_heads)
        if src.transpose:
            t = t.T
        if ".c_attn." in src.key:  # GPT-2's fused QKV: (C, 3C) weight, (3C,) bias; t is one third of it
            fused = tensors.setdefault(src.key, torch.empty(*t.shape[:-1], 3 * model.hidden))
            fused.narrow(-1, src.offset, t.shape[-1]).copy_(t)
        else:
            tensors[src.key] = t.contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.dumps(hf_config(model, eos_token_id), indent=2) + "\n"
    write_atomically(out / WEIGHTS, lambda f: f.write(save(tensors, metadata={"format": "pt"})))
    for name, data in (extra_files or {}).items():
        write_atomically(out / name, methodcaller("write", data))
    write_atomically(out / CONFIG, lambda f: f.write(config.encode()))  # last: the folder is complete once it is there
    return out


# ------------------------------------------------------------------------------------------
# Import: each rank reads only its slices


def _weight_files(folder: Path) -> dict[str, Path]:
    """HF key -> the safetensors file holding it."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: folder / name for key, name in weight_map.items()}
    from safetensors import safe_open

    with safe_open(folder / WEIGHTS, framework="pt") as f:
        return dict.fromkeys(f.keys(), folder / WEIGHTS)


def check_weights(layout: Layout, values_per_read: int = 1 << 22) -> None:
    """Every weight ``layout.model`` reads from ``init_from`` is finite: read once, a few million values at a
    time (the launcher calls it before any rank starts, as it verifies a checkpoint it resumes)."""
    from safetensors import safe_open

    folder = Path(layout.model.init_from)
    files = _weight_files(folder)
    keys = [gpt2_key(key, files) for key in hf_shapes(layout.model, json.loads((folder / CONFIG).read_text()))]
    for path in dict.fromkeys(files[key] for key in keys):
        with safe_open(path, framework="pt") as f:
            for key in (k for k in keys if files[k] == path):
                view = f.get_slice(key)
                shape = view.get_shape()
                rows = max(1, values_per_read // max(1, math.prod(shape[1:])))
                for lo in range(0, shape[0], rows):
                    _check_finite(view[lo : lo + rows], key, path, layout.file)


def _check_finite(t, key: str, path: Path, file: str | None = None) -> None:
    """A one-line error naming the tensor ``key`` when ``t`` (a part of it) holds NaN or infinite values;
    located at ``file``'s model.init_from (the layout), else at the weights file ``path``."""
    import torch

    if not bool(torch.isfinite(t).all()):
        nan, inf = bool(torch.isnan(t).any()), bool(torch.isinf(t).any())
        what = "NaN and infinite values" if nan and inf else "NaN values" if nan else "infinite values"
        where = f"{path}: tensor '{key}'" if file else f"tensor '{key}'"
        raise LayoutError(
            file or str(path),
            "model.init_from",
            f"{where} holds {what} (start from a model whose weights are all finite)",
        )


def load_shards(model: ModelSpec, shards: list[tuple[Any, int, int]]) -> dict[str, Any]:
    """The float32 tensors of ``shards`` ((ParamInfo, lo, hi) as ``Plan.params_of`` lists them) read from
    ``model.init_from``: only the rows or columns each shard covers are read from disk."""
    from safetensors import safe_open

    folder = Path(model.init_from)
    files = _weight_files(folder)
    src_of = weight_sources(model)
    out: dict[str, Any] = {}
    handles: dict[Path, Any] = {}
    try:
        for info, lo, hi in shards:
            src = src_of[info.name]
            key = gpt2_key(src.key, files)
            if key not in files:
                raise LayoutError(
                    str(folder / WEIGHTS),
                    "model.init_from",
                    f"{info.name} is not in the file (no "
                    f"tensor '{src.key}'): save the model again with save_pretrained",
                )
            path = files[key]
            if path not in handles:
                handles[path] = safe_open(path, framework="pt").__enter__()
            out[info.name] = _read(handles[path].get_slice(key), info, lo, hi, src).float().contiguous()
            _check_finite(out[info.name], key, path)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return out


def _read(view, info, lo: int, hi: int, src: Source):
    """Our [lo, hi) along ``info.shard_dim`` (dim 0 when replicated) of the tensor ``src`` describes."""
    dim = info.shard_dim or 0
    if info.shard_dim is None:
        lo, hi = 0, info.shape[0]  # replicated: the whole tensor (embed.pos: the first seq_len rows)
    if len(info.shape) == 1:
        part = view[src.offset + lo : src.offset + hi]
    elif src.transpose:  # ours = theirs[:, offset:offset + rows].T
        if dim == 0:
            return view[:, src.offset + lo : src.offset + hi].T
        return view[lo:hi, src.offset : src.offset + info.shape[0]].T
    else:
        part = view[lo:hi] if dim == 0 else view[:, lo:hi]
    if src.rope_heads:  # TP shards whole heads, so the permutation stays inside the slice
        part = _to_ours_order(part, src.rope_heads * (hi - lo) // info.shape[0])
    return part
