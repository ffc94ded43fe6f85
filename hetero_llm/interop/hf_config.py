"""Hugging Face ``config.json``: ours from a [model], and a model directory's checked against a [model].

``check_config`` refuses (one located line, with the fix) a ``model.init_from`` directory whose config is
not this [model], sets a field whose math the model does not have, or whose safetensors headers do not hold
the tensors of that config (no weight is read). Torch-free: it runs in the launcher's preflight.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hetero_llm._fs import loads_json, not_regular
from hetero_llm.errors import LayoutError
from hetero_llm.interop.hf_names import (
    CONFIG,
    GPT2,
    LLAMA,
    NEITHER,
    WEIGHTS,
    WEIGHTS_INDEX,
    describe_model,
    gpt2_key,
    hf_shapes,
    kind_of,
)
from hetero_llm.layout import Layout, ModelSpec

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
# and summary_* (GPT2DoubleHeadsModel only). tests/unit/test_hf_fields.py sweeps every field of both configs.
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
    what = not_regular(folder / CONFIG)
    if what:
        raise LayoutError(f, "model.init_from", f"{folder / CONFIG} is {what}, not a regular file ({fix})")
    try:
        cfg = loads_json((folder / CONFIG).read_text())
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


def _header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (8 bytes of length, then {key: {dtype, shape, data_offsets}})."""
    what = not_regular(path)
    if what:  # opening a FIFO would wait for a writer
        raise ValueError(f"{path} is {what}, not a regular file")
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > 1 << 28:
            raise ValueError(f"a header of {size} bytes")
        header = loads_json(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("its header is no JSON object")
    # the tensors' bytes follow the header: a truncated file is named here, not by safetensors in every rank
    ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__" and isinstance(e, dict)]
    held = os.path.getsize(path) - 8 - size
    if max(ends, default=0) > held:
        raise ValueError(f"truncated: its header places tensor data up to byte {max(ends)}, but it holds {held}")
    return header


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
                for key, name in loads_json((folder / WEIGHTS_INDEX).read_text())["weight_map"].items()
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
        key = gpt2_key(key, where)
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


def check_export(model: ModelSpec, where: str, path: str) -> None:
    """Raise a located error when ``model`` has no Hugging Face architecture to export to."""
    if kind_of(model) is None:
        raise LayoutError(
            where,
            path,
            f"{describe_model(model)} {NEITHER}: transformers has no class for it (train with one of those to export)",
        )
