"""Hugging Face names: which architecture a [model] is, and where each of our parameters lives in its files.

``weight_sources`` maps our global parameter names to Llama / GPT-2 tensor names (and the transposes, offsets
and RoPE permutations between them; ``hf`` says why each is there), ``hf_shapes`` gives the shape a file
must hold under each name. Torch-free: config checks (``hf_config``) and weight I/O (``hf``) both read it.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from hetero_llm.layout import Mlp, ModelSpec, Norm, Position
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
            shape = (cfg["n_positions"], model.hidden)  # check_config refuses a GPT-2 config without it
        out[src.key] = shape
    return out


def gpt2_key(key: str, available: dict[str, Path]) -> str:
    """GPT-2 files saved from GPT2Model (the hub's) have no 'transformer.' prefix."""
    if key not in available and key.startswith("transformer.") and key[len("transformer.") :] in available:
        return key[len("transformer.") :]
    return key
