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

Torch-free at import (``check_config`` runs in layout validation); torch and safetensors load on use.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import attrs

from hetero_llm._fs import write_atomically
from hetero_llm.errors import LayoutError
from hetero_llm.layout import Layout, Mlp, ModelSpec, Norm, Position
from hetero_llm.model.params import BIAS_OF, all_params

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # sharded checkpoints: {"weight_map": {key: file}}

LLAMA = "llama"
GPT2 = "gpt2"


def kind_of(model: ModelSpec) -> str | None:
    """Which Hugging Face architecture ``model`` is: 'llama', 'gpt2', or None (neither)."""
    if (model.norm, model.position, model.mlp) == (Norm.RMSNORM, Position.ROPE, Mlp.SWIGLU):
        return LLAMA
    if (model.norm, model.position, model.mlp) == (Norm.LAYERNORM, Position.LEARNED, Mlp.GELU):
        if model.kv_heads_n == model.heads:
            return GPT2
    return None


NEITHER = (
    "matches neither Llama (norm 'rmsnorm', position 'rope', mlp 'swiglu') nor GPT-2 (norm 'layernorm', "
    "position 'learned', mlp 'gelu', no kv_heads)"
)


def describe_model(model: ModelSpec) -> str:
    return f"[model] norm '{model.norm.value}', position '{model.position.value}', mlp '{model.mlp.value}'" + (
        f", kv_heads {model.kv_heads}" if model.kv_heads else ""
    )


# ------------------------------------------------------------------------------------------
# config.json


def hf_config(model: ModelSpec, eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``model`` (its kind must not be None)."""
    kind = kind_of(model)
    common = {
        "vocab_size": model.vocab,
        "tie_word_embeddings": model.tie_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
    }
    if kind == LLAMA:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": LLAMA,
            "hidden_size": model.hidden,
            "intermediate_size": model.ffn_width,
            "num_hidden_layers": model.layers,
            "num_attention_heads": model.heads,
            "num_key_value_heads": model.kv_heads_n,
            "head_dim": model.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": model.seq_len,
            "rms_norm_eps": model.norm_eps,
            "rope_theta": model.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
            "attention_bias": model.bias,
            "mlp_bias": model.bias,
            "attention_dropout": 0.0,
            **common,
        }
    if kind == GPT2:
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": GPT2,
            "n_embd": model.hidden,
            "n_inner": model.ffn_width,
            "n_layer": model.layers,
            "n_head": model.heads,
            "n_positions": model.seq_len,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": model.norm_eps,
            "attn_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "resid_pdrop": 0.0,
            **common,
        }
    raise ValueError(f"{describe_model(model)} {NEITHER}")


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _expected(cfg: dict, model: ModelSpec) -> list[tuple[str, Any, str, Any]]:
    """(config key, its value, our [model] key, our value) pairs that must agree."""
    if cfg.get("model_type") == LLAMA:
        heads = cfg.get("num_attention_heads")
        return [
            ("hidden_size", cfg.get("hidden_size"), "hidden", model.hidden),
            ("num_hidden_layers", cfg.get("num_hidden_layers"), "layers", model.layers),
            ("num_attention_heads", heads, "heads", model.heads),
            ("num_key_value_heads", cfg.get("num_key_value_heads") or heads, "kv_heads", model.kv_heads_n),
            ("intermediate_size", cfg.get("intermediate_size"), "ffn", model.ffn_width),
            ("vocab_size", cfg.get("vocab_size"), "vocab", model.vocab),
            ("rms_norm_eps", cfg.get("rms_norm_eps", 1e-6), "norm_eps", model.norm_eps),
            ("rope_theta", _rope_theta(cfg), "rope_theta", model.rope_theta),
            ("tie_word_embeddings", cfg.get("tie_word_embeddings", False), "tie_embeddings", model.tie_embeddings),
            ("attention_bias", cfg.get("attention_bias", False), "bias", model.bias),
            ("mlp_bias", cfg.get("mlp_bias", False), "bias", model.bias),
            ("norm", "rmsnorm", "norm", model.norm.value),
            ("position", "rope", "position", model.position.value),
            ("mlp", "swiglu", "mlp", model.mlp.value),
        ]
    if cfg.get("model_type") == GPT2:
        return [
            ("n_embd", cfg.get("n_embd"), "hidden", model.hidden),
            ("n_layer", cfg.get("n_layer"), "layers", model.layers),
            ("n_head", cfg.get("n_head"), "heads", model.heads),
            ("n_inner", cfg.get("n_inner") or 4 * (cfg.get("n_embd") or 0), "ffn", model.ffn_width),
            ("vocab_size", cfg.get("vocab_size"), "vocab", model.vocab),
            ("layer_norm_epsilon", cfg.get("layer_norm_epsilon", 1e-5), "norm_eps", model.norm_eps),
            ("tie_word_embeddings", cfg.get("tie_word_embeddings", True), "tie_embeddings", model.tie_embeddings),
            ("biases", True, "bias", model.bias),
            ("key/value heads", cfg.get("n_head"), "kv_heads", model.kv_heads_n),
            ("norm", "layernorm", "norm", model.norm.value),
            ("position", "learned", "position", model.position.value),
            ("mlp", "gelu", "mlp", model.mlp.value),
        ]
    return []


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"'{value}'" if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)


# config.json fields that change the math and that [model] has no key for: ``_unsupported`` refuses every value
# but those our model computes exactly. A field it does not look at either has its [model] key (``_expected``)
# or leaves the logits alone: dropout (ours has none: eval logits are the same, and training
# goes on without it), pretraining_tp (in transformers < 5 only splits the same matmuls), use_cache,
# initializer_range, token ids, max_position_embeddings (default RoPE computes any position), GPT-2's
# reorder_and_upcast_attn (the same math in float32), add_cross_attention (unused without encoder states)
# and summary_* (GPT2DoubleHeadsModel only). tests/test_hf_fields.py sweeps every field of both configs.
SILU = ("silu", "swish")  # transformers' ACT2FN: both are x * sigmoid(x)
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_fast", "gelu_accurate")  # 0.5x(1 + tanh(..))
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _unsupported(cfg: dict) -> tuple[str, Any, str] | None:
    """The first config.json field whose value our model cannot compute: (field, value, what is supported)."""
    if cfg.get("quantization_config") is not None:
        method = (
            (cfg["quantization_config"] or {}).get("quant_method", "?")
            if isinstance(cfg["quantization_config"], dict)
            else "?"
        )
        return (
            "quantization_config.quant_method",
            method,
            "only unquantized float weights: save the model dequantized",
        )
    if cfg["model_type"] == LLAMA:
        hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
        act = cfg.get("hidden_act", "silu")
        if act not in SILU:
            return "hidden_act", act, "only 'silu': [model] mlp 'swiglu' gates with silu"
        head_dim = cfg.get("head_dim")
        if (
            head_dim is not None
            and isinstance(hidden, int)
            and isinstance(heads, int)
            and heads > 0
            and head_dim != hidden // heads
        ):
            return (
                "head_dim",
                head_dim,
                f"only hidden_size / num_attention_heads = {hidden // heads}: [model] has no head size of its own",
            )
        for key in ("rope_parameters", "rope_scaling"):
            rope = cfg.get(key)
            if isinstance(rope, dict):
                for type_key in ("rope_type", "type"):
                    if rope.get(type_key, "default") != "default":
                        return f"{key}.{type_key}", rope[type_key], "only the default RoPE: no scaling"
            elif rope is not None:
                return key, rope, "only the default RoPE: no scaling"
        if cfg.get("attention_bias", False) != cfg.get("mlp_bias", False):
            return (
                "attention_bias",
                cfg.get("attention_bias", False),
                f"only equal to mlp_bias "
                f"({_toml(cfg.get('mlp_bias', False))}): model.bias puts biases on every projection or none",
            )
        return None
    act = cfg.get("activation_function", "gelu_new")
    if act not in GELU_TANH:
        return (
            "activation_function",
            act,
            "only 'gelu_new' or 'gelu_pytorch_tanh': [model] mlp 'gelu' is GELU's tanh form",
        )
    if not cfg.get("scale_attn_weights", True):
        return "scale_attn_weights", False, "only true: scores divided by sqrt(head size)"
    if cfg.get("scale_attn_by_inverse_layer_idx", False):
        return "scale_attn_by_inverse_layer_idx", True, "only false: every layer's scores scaled alike"
    return None


def check_config(layout: Layout) -> None:
    """``model.init_from`` is a Hugging Face Llama/GPT-2 directory whose config is this [model]."""
    f, model = layout.file, layout.model
    folder = Path(model.init_from)
    fix = "give a local Hugging Face model directory: config.json + model.safetensors"
    if not folder.is_dir():
        raise LayoutError(f, "model.init_from", f"'{folder}' is not a folder ({fix})")
    try:
        cfg = json.loads((folder / CONFIG).read_text())
    except FileNotFoundError:
        raise LayoutError(f, "model.init_from", f"'{folder}' has no {CONFIG} ({fix})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise LayoutError(f, "model.init_from", f"{folder / CONFIG} is not JSON ({e}) ({fix})") from None
    if not isinstance(cfg, dict) or cfg.get("model_type") not in (LLAMA, GPT2):
        kind = cfg.get("model_type") if isinstance(cfg, dict) else None
        raise LayoutError(
            f,
            "model.init_from",
            f"{folder / CONFIG}: model_type {kind!r} is not 'llama' or 'gpt2' "
            "(only those two architectures can be loaded)",
        )
    if not (folder / WEIGHTS).is_file() and not (folder / WEIGHTS_INDEX).is_file():
        raise LayoutError(
            f,
            "model.init_from",
            f"'{folder}' has no {WEIGHTS} (save the model with safetensors: "
            "model.save_pretrained(dir, safe_serialization=True))",
        )
    refused = _unsupported(cfg)
    if refused:
        field, value, supported = refused
        raise LayoutError(
            f, "model.init_from", f"{folder / CONFIG}: {field} {_toml(value)} is not supported ({supported})"
        )
    if cfg["model_type"] == GPT2 and cfg.get("n_positions", 0) < model.seq_len:
        raise LayoutError(
            f,
            "model.init_from",
            f"{folder / CONFIG}: n_positions {cfg.get('n_positions')} is shorter "
            f"than model.seq_len {model.seq_len} (set model.seq_len <= {cfg.get('n_positions')})",
        )
    for key, theirs, ours_key, ours in _expected(cfg, model):
        same = abs(theirs - ours) <= 1e-9 * abs(ours) if isinstance(ours, float) else theirs == ours
        if not same:
            raise LayoutError(
                f,
                "model.init_from",
                f"{folder / CONFIG} is a {cfg['model_type']} model with {key} "
                f"{_toml(theirs)} but model.{ours_key} is {_toml(ours)} "
                f"(set model.{ours_key} = {_toml(theirs)})",
            )
    _check_shapes(layout, cfg)


# ------------------------------------------------------------------------------------------
# Weight names: each of our parameters is a view of one HF tensor.


@attrs.frozen
class Source:
    """Where our parameter lives in the HF file: ``key``, then (GPT-2's fused c_attn) rows/columns
    [offset, offset + size) of its output dim, transposed (Conv1D), or each head's rows permuted (RoPE)."""

    key: str
    transpose: bool = False
    offset: int = 0
    rope_heads: int = 0  # > 0: this many heads whose rows go from HF's half-split order to our pair order


def weight_sources(model: ModelSpec) -> dict[str, Source]:
    """Our global parameter name -> its ``Source`` (names absent from the HF file are absent here)."""
    kind = kind_of(model)
    out: dict[str, Source] = {}
    if kind == LLAMA:
        out["embed.tok"] = Source("model.embed_tokens.weight")
        out["final_norm.weight"] = Source("model.norm.weight")
        if not model.tie_embeddings:
            out["lm_head.weight"] = Source("lm_head.weight")
        names = {
            "attn_norm.weight": "input_layernorm.weight",
            "mlp_norm.weight": "post_attention_layernorm.weight",
            "attn.wq": "self_attn.q_proj.weight",
            "attn.wk": "self_attn.k_proj.weight",
            "attn.wv": "self_attn.v_proj.weight",
            "attn.wo": "self_attn.o_proj.weight",
            "mlp.w1": "mlp.gate_proj.weight",
            "mlp.w3": "mlp.up_proj.weight",
            "mlp.w2": "mlp.down_proj.weight",
            "attn.bq": "self_attn.q_proj.bias",
            "attn.bk": "self_attn.k_proj.bias",
            "attn.bv": "self_attn.v_proj.bias",
            "attn.bo": "self_attn.o_proj.bias",
            "mlp.b1": "mlp.gate_proj.bias",
            "mlp.b3": "mlp.up_proj.bias",
            "mlp.b2": "mlp.down_proj.bias",
        }
        rope = {
            "attn.wq": model.heads,
            "attn.bq": model.heads,
            "attn.wk": model.kv_heads_n,
            "attn.bk": model.kv_heads_n,
        }
        for i in range(model.layers):
            for ours, theirs in names.items():
                if ours.split(".")[-1] in BIAS_OF.values() and not model.bias:
                    continue
                out[f"layers.{i}.{ours}"] = Source(f"model.layers.{i}.{theirs}", rope_heads=rope.get(ours, 0))
        return out
    if kind == GPT2:
        C = model.hidden
        out["embed.tok"] = Source("transformer.wte.weight")
        out["embed.pos"] = Source("transformer.wpe.weight")
        out["final_norm.weight"] = Source("transformer.ln_f.weight")
        out["final_norm.bias"] = Source("transformer.ln_f.bias")
        if not model.tie_embeddings:
            out["lm_head.weight"] = Source("lm_head.weight")
        for i in range(model.layers):
            h = f"transformer.h.{i}"
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                out[f"layers.{i}.{ours}.weight"] = Source(f"{h}.{theirs}.weight")
                out[f"layers.{i}.{ours}.bias"] = Source(f"{h}.{theirs}.bias")
            for j, (w, b) in enumerate((("wq", "bq"), ("wk", "bk"), ("wv", "bv"))):
                out[f"layers.{i}.attn.{w}"] = Source(f"{h}.attn.c_attn.weight", transpose=True, offset=j * C)
                out[f"layers.{i}.attn.{b}"] = Source(f"{h}.attn.c_attn.bias", offset=j * C)
            for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.w1", "mlp.c_fc"), ("mlp.w2", "mlp.c_proj")):
                out[f"layers.{i}.{ours}"] = Source(f"{h}.{theirs}.weight", transpose=True)
                prefix, leaf = ours.split(".")
                out[f"layers.{i}.{prefix}.{BIAS_OF[leaf]}"] = Source(f"{h}.{theirs}.bias")
        return out  # GPT-2 always has biases: a model without them exports zeros
    raise ValueError(f"{describe_model(model)} {NEITHER}")


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
        write_atomically(out / name, lambda f, data=data: f.write(data))
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


def _gpt2_key(key: str, available: dict[str, Path]) -> str:
    """GPT-2 files saved from GPT2Model (the hub's) have no 'transformer.' prefix."""
    if key not in available and key.startswith("transformer.") and key[len("transformer.") :] in available:
        return key[len("transformer.") :]
    return key


def _header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (8 bytes of length, then {key: {dtype, shape, data_offsets}})."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > 1 << 28:
            raise ValueError(f"a header of {size} bytes")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("its header is no JSON object")
    return header


def hf_shapes(model: ModelSpec, cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF key -> the shape the file must give it for ``model`` (its config ``cfg``): ours, transposed for
    GPT-2's Conv1D, c_attn three times as wide, GPT-2's position embedding n_positions long."""
    shapes = {info.name: info.shape for info in all_params(attrs.evolve(model, bias=True))}
    out: dict[str, tuple[int, ...]] = {}
    for name, src in weight_sources(model).items():
        shape = tuple(shapes[name])[::-1] if src.transpose else tuple(shapes[name])
        if ".c_attn." in src.key:
            shape = (*shape[:-1], 3 * model.hidden)
        if name == "embed.pos":
            shape = (cfg.get("n_positions"), model.hidden)
        out[src.key] = shape
    return out


def _check_shapes(layout: Layout, cfg: dict) -> None:
    """Every tensor ``layout.model`` reads is in the safetensors file(s), a float, of the shape config.json and
    [model] give it (the files' headers only: no weight is read)."""
    f, model = layout.file, layout.model
    folder = Path(model.init_from)
    fix = "save the model again with save_pretrained"
    try:
        if (folder / WEIGHTS_INDEX).is_file():
            where = {
                key: folder / name
                for key, name in json.loads((folder / WEIGHTS_INDEX).read_text())["weight_map"].items()
            }
        else:
            where = dict.fromkeys(_header(folder / WEIGHTS), folder / WEIGHTS)
        headers = {path: _header(path) for path in set(where.values())}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        bad = folder / (WEIGHTS_INDEX if (folder / WEIGHTS_INDEX).is_file() else WEIGHTS)
        raise LayoutError(
            f, "model.init_from", f"{bad} is not a safetensors model ({type(e).__name__}: {e}) ({fix})"
        ) from None
    for key, shape in hf_shapes(model, cfg).items():
        key = _gpt2_key(key, where)
        if key not in where or key not in headers[where[key]]:
            raise LayoutError(
                f,
                "model.init_from",
                f"{folder / WEIGHTS}: no tensor '{key}', which config.json's {cfg['model_type']} model has ({fix})",
            )
        entry = headers[where[key]][key]
        got = tuple(entry.get("shape", ()))
        if entry.get("dtype") not in FLOAT_DTYPES:
            raise LayoutError(
                f,
                "model.init_from",
                f"{where[key]}: tensor '{key}' is {entry.get('dtype')}, not a float "
                f"({', '.join(FLOAT_DTYPES)}) (give unquantized weights)",
            )
        if got != shape:
            raise LayoutError(
                f,
                "model.init_from",
                f"{where[key]}: tensor '{key}' has shape {list(got)} but "
                f"config.json gives it {list(shape)} (the weights are not those of config.json: {fix})",
            )


def check_weights(layout: Layout, values_per_read: int = 1 << 22) -> None:
    """Every weight ``layout.model`` reads from ``init_from`` is finite: read once, a few million values at a
    time (the launcher calls it before any rank starts, as it verifies a checkpoint it resumes)."""
    from safetensors import safe_open

    folder = Path(layout.model.init_from)
    files = _weight_files(folder)
    keys = [_gpt2_key(key, files) for key in hf_shapes(layout.model, json.loads((folder / CONFIG).read_text()))]
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
            key = _gpt2_key(src.key, files)
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


def check_export(model: ModelSpec, where: str, path: str) -> None:
    """Raise a located error when ``model`` has no Hugging Face architecture to export to."""
    if kind_of(model) is None:
        raise LayoutError(
            where,
            path,
            f"{describe_model(model)} {NEITHER}: transformers has no class for it (train with one of those to export)",
        )
