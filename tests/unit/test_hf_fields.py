"""Every field of transformers' LlamaConfig and GPT2Config that changes the math: a model saved with it either
loads into ours with transformers' logits (1e-5 relative) or is refused in one line naming the config.json
field, its value and what is supported. Tiny models are built here with transformers, never downloaded.

Each refused value is also shown to change transformers' own logits (so refusing it is not overcaution), and
``test_every_config_field_is_swept_or_leaves_the_math_alone`` fails when a transformers release adds a field
this sweep has not classified."""

from __future__ import annotations

import inspect
import json

import pytest

torch = pytest.importorskip("torch", reason="the interop needs torch (a core dependency: always there, CI included)")
transformers = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")

from harness import (
    TINY_HF,
    assert_one_error_line,
    full_model_logits,
    full_shards,
    hf_layout_text,
    invoke_cli,
    relative_error,
    tiny_hf_model,
)
from hetero_llm import layout as layout_mod
from hetero_llm.errors import LayoutError
from hetero_llm.interop import hf, hf_config, hf_names

RTOL = 1e-5
SEQ = 16


def lines(kind: str, **changes) -> str:
    """TINY_HF's [model] lines of ``kind`` with ``changes`` (key -> TOML value, or None to drop the key)."""
    out = dict(line.split(" = ", 1) for line in TINY_HF[kind][1].splitlines())
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return "".join(f"{k} = {v}\n" for k, v in out.items())


# (id, kind, transformers config overrides, our [model] lines): loads with transformers' logits.
SUPPORTED = [
    ("llama defaults", "llama", {}, lines("llama")),
    ("llama num_key_value_heads", "llama", dict(num_key_value_heads=2), lines("llama", kv_heads="2")),
    ("llama rms_norm_eps", "llama", dict(rms_norm_eps=1e-5), lines("llama", norm_eps="1e-5")),
    (
        "llama rope_theta",
        "llama",
        dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        lines("llama", rope_theta="500000.0"),
    ),
    ("llama tie_word_embeddings", "llama", dict(tie_word_embeddings=True), lines("llama", tie_embeddings="true")),
    ("llama attention_bias + mlp_bias", "llama", dict(attention_bias=True, mlp_bias=True), lines("llama", bias="true")),
    ("llama attention_dropout", "llama", dict(attention_dropout=0.1), lines("llama")),
    ("llama pretraining_tp", "llama", dict(pretraining_tp=2), lines("llama")),
    ("llama hidden_act swish", "llama", dict(hidden_act="swish"), lines("llama")),
    ("llama head_dim = hidden / heads", "llama", dict(head_dim=8), lines("llama")),
    ("llama max_position_embeddings < seq_len", "llama", dict(max_position_embeddings=8), lines("llama")),
    ("llama intermediate_size", "llama", dict(intermediate_size=40), lines("llama", ffn="40")),
    ("gpt2 defaults", "gpt2", {}, lines("gpt2")),  # dropouts 0.1, gelu_new, tied
    *[
        (f"gpt2 activation_function {act}", "gpt2", dict(activation_function=act), lines("gpt2"))
        for act in hf_config.GELU_TANH
        if act != "gelu_new"
    ],
    ("gpt2 n_inner", "gpt2", dict(n_inner=40), lines("gpt2", ffn="40")),
    ("gpt2 n_inner None", "gpt2", dict(n_inner=None), lines("gpt2", ffn="128")),
    ("gpt2 layer_norm_epsilon", "gpt2", dict(layer_norm_epsilon=1e-6), lines("gpt2", norm_eps="1e-6")),
    ("gpt2 tie_word_embeddings false", "gpt2", dict(tie_word_embeddings=False), lines("gpt2", tie_embeddings=None)),
    ("gpt2 n_positions > seq_len", "gpt2", dict(n_positions=32), lines("gpt2")),
    (
        "gpt2 reorder_and_upcast_attn",
        "gpt2",
        dict(reorder_and_upcast_attn=True, attn_implementation="eager"),
        lines("gpt2"),
    ),
    ("gpt2 add_cross_attention", "gpt2", dict(add_cross_attention=True), lines("gpt2")),
    ("gpt2 scale_attn_weights true", "gpt2", dict(scale_attn_weights=True, attn_implementation="eager"), lines("gpt2")),
]


@pytest.mark.parametrize("kind,overrides,model_lines", [c[1:] for c in SUPPORTED], ids=[c[0] for c in SUPPORTED])
def test_a_supported_field_loads_with_transformers_logits(kind, overrides, model_lines, tmp_path):
    theirs = tiny_hf_model(kind, tmp_path / "hf", **overrides)
    (tmp_path / "layout.toml").write_text(hf_layout_text(model_lines, tmp_path / "hf"))
    lay = layout_mod.load(tmp_path / "layout.toml")  # validation: hf_config.check_config, the files' shapes
    hf.check_weights(lay)
    params = hf.load_shards(lay.model, full_shards(lay.model))
    ids = torch.randint(0, 64, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert relative_error(full_model_logits(params, lay.model, ids), theirs(ids).logits) <= RTOL


def _legacy(key: str, value):
    """Edit config.json as an older transformers (or another tool) wrote it: ``key`` set to ``value``."""

    def edit(cfg: dict) -> None:
        cfg[key] = value

    return edit


# (id, kind, transformers overrides, config.json edit or None, [model] lines, the refusal after 'config.json: ',
#  whether the same weights under the default field give other logits in transformers itself)
REFUSED = [
    (
        "llama head_dim",
        "llama",
        dict(head_dim=16),
        None,
        lines("llama"),
        ": head_dim 16 is not supported (only hidden_size / num_attention_heads = 8: [model] has no head size of its "
        "own)",
        False,
    ),
    (
        "llama hidden_act gelu",
        "llama",
        dict(hidden_act="gelu"),
        None,
        lines("llama"),
        ": hidden_act 'gelu' is not supported (only 'silu': [model] mlp 'swiglu' gates with silu)",
        True,
    ),
    (
        "llama hidden_act relu",
        "llama",
        dict(hidden_act="relu"),
        None,
        lines("llama"),
        ": hidden_act 'relu' is not supported (only 'silu': [model] mlp 'swiglu' gates with silu)",
        True,
    ),
    (
        "llama attention_bias alone",
        "llama",
        dict(attention_bias=True),
        None,
        lines("llama", bias="true"),
        ": attention_bias true is not supported (only equal to mlp_bias (false): model.bias puts biases on every "
        "projection or none)",
        False,
    ),
    (
        "llama mlp_bias alone",
        "llama",
        dict(mlp_bias=True),
        None,
        lines("llama", bias="true"),
        ": attention_bias false is not supported (only equal to mlp_bias (true): model.bias puts biases on every "
        "projection or none)",
        False,
    ),
    (
        "llama rope linear",
        "llama",
        dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
        None,
        lines("llama"),
        ": rope_parameters.rope_type 'linear' is not supported (only the default RoPE: no scaling)",
        True,
    ),
    (
        "llama rope llama3",
        "llama",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "rope_theta": 10000.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 4,
            }
        ),
        None,
        lines("llama"),
        ": rope_parameters.rope_type 'llama3' is not supported (only the default RoPE: no scaling)",
        True,
    ),
    (
        "llama legacy rope_scaling type",
        "llama",
        {},
        _legacy("rope_scaling", {"type": "linear", "factor": 2.0}),
        lines("llama"),
        ": rope_scaling.type 'linear' is not supported (only the default RoPE: no scaling)",
        True,
    ),
    (
        "llama quantization_config",
        "llama",
        {},
        _legacy("quantization_config", {"quant_method": "bitsandbytes"}),
        lines("llama"),
        ": quantization_config.quant_method 'bitsandbytes' is not supported (only unquantized float "
        "weights: save the model dequantized)",
        False,
    ),
    (
        "llama intermediate_size vs ffn",
        "llama",
        dict(intermediate_size=40),
        None,
        lines("llama"),  # [model] differs
        " is a llama model with intermediate_size 40 but model.ffn is 48 (set model.ffn = 40)",
        False,
    ),
    (
        "gpt2 activation_function relu",
        "gpt2",
        dict(activation_function="relu"),
        None,
        lines("gpt2"),
        ": activation_function 'relu' is not supported (only 'gelu_new' or 'gelu_pytorch_tanh': [model] mlp 'gelu' is "
        "GELU's tanh form)",
        True,
    ),
    (
        "gpt2 activation_function gelu",
        "gpt2",
        dict(activation_function="gelu"),
        None,
        lines("gpt2"),
        ": activation_function 'gelu' is not supported (only 'gelu_new' or 'gelu_pytorch_tanh': [model] mlp 'gelu' is "
        "GELU's tanh form)",
        True,
    ),
    (
        "gpt2 scale_attn_weights false",
        "gpt2",
        dict(scale_attn_weights=False),
        None,
        lines("gpt2"),
        ": scale_attn_weights false is not supported (only true: scores divided by sqrt(head size))",
        True,
    ),
    (
        "gpt2 scale_attn_by_inverse_layer_idx",
        "gpt2",
        dict(scale_attn_by_inverse_layer_idx=True),
        None,
        lines("gpt2"),
        ": scale_attn_by_inverse_layer_idx true is not supported (only false: every layer's scores scaled alike)",
        True,
    ),
    (
        "gpt2 n_positions < seq_len",
        "gpt2",
        dict(n_positions=8),
        None,
        lines("gpt2"),
        ": n_positions 8 is shorter than model.seq_len 16 (set model.seq_len <= 8)",
        False,
    ),
]


@pytest.mark.parametrize(
    "name,kind,overrides,edit,model_lines,refusal,changes_math", REFUSED, ids=[c[0] for c in REFUSED]
)
def test_an_unsupported_field_is_refused_in_one_line(
    name, kind, overrides, edit, model_lines, refusal, changes_math, tmp_path
):
    theirs = tiny_hf_model(kind, tmp_path / "hf", **overrides)
    config = tmp_path / "hf" / "config.json"
    if edit:
        cfg = json.loads(config.read_text())
        edit(cfg)
        config.write_text(json.dumps(cfg))
    layout = tmp_path / "layout.toml"
    layout.write_text(hf_layout_text(model_lines, tmp_path / "hf"))
    assert_one_error_line(invoke_cli(layout, "--dry-run"), f"{layout}: model.init_from: {config}{refusal}")
    if changes_math:  # the same weights under the default field: transformers' own logits move past the tolerance
        if edit:
            theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        default = tiny_hf_model(kind, None)
        default.load_state_dict(theirs.state_dict())
        ids = torch.randint(0, 64, (3, SEQ), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert relative_error(theirs(ids).logits, default(ids).logits) > RTOL


# Fields of the two configs (transformers 4.40 to 5.x) whose effect on the logits is none, or is covered above.
SWEPT = {name for case in SUPPORTED + REFUSED for name in case[2]} | {
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "quantization_config",
    "n_positions",
    "max_position_embeddings",
    "hidden_size",
    "n_embd",
    "num_hidden_layers",
    "n_layer",
    "num_attention_heads",
    "n_head",
    "vocab_size",
}
NO_MATH = {
    "transformers_version": "metadata",
    "architectures": "metadata",
    "dtype": "storage dtype (read as float32)",
    "torch_dtype": "storage dtype (read as float32)",
    "output_hidden_states": "outputs only",
    "return_dict": "outputs only",
    "chunk_size_feed_forward": "unused by Llama and GPT-2",
    "is_encoder_decoder": "no encoder in a causal LM",
    "id2label": "classification heads only",
    "label2id": "classification heads only",
    "problem_type": "classification heads only",
    "initializer_range": "init only: the weights are read",
    "use_cache": "generation speed",
    "pad_token_id": "token ids",
    "bos_token_id": "token ids",
    "eos_token_id": "token ids",
    "resid_pdrop": "dropout: none in eval (swept by 'gpt2 defaults', 0.1)",
    "embd_pdrop": "dropout (as resid_pdrop)",
    "attn_pdrop": "dropout (as resid_pdrop)",
    "summary_type": "GPT2DoubleHeadsModel only",
    "summary_use_proj": "GPT2DoubleHeadsModel only",
    "summary_activation": "GPT2DoubleHeadsModel only",
    "summary_proj_to_labels": "GPT2DoubleHeadsModel only",
    "summary_first_dropout": "GPT2DoubleHeadsModel only",
}


@pytest.mark.parametrize("config_class", ["LlamaConfig", "GPT2Config"])
def test_every_config_field_is_swept_or_leaves_the_math_alone(config_class):
    fields = {
        name
        for name, p in inspect.signature(getattr(transformers, config_class).__init__).parameters.items()
        if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }
    assert fields - SWEPT - set(NO_MATH) == set(), f"{config_class}: fields neither swept nor classified"


def test_a_weight_of_the_wrong_shape_is_refused_before_anything_starts(tmp_path):
    """config.json and the weights disagree (a file from another model): the header names the tensor."""
    from safetensors.torch import load_file, save_file

    tiny_hf_model("llama", tmp_path / "hf")
    weights = tmp_path / "hf" / hf_names.WEIGHTS
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(40, 32)
    save_file(tensors, weights)
    layout = tmp_path / "layout.toml"
    layout.write_text(hf_layout_text(lines("llama"), tmp_path / "hf"))
    assert_one_error_line(
        invoke_cli(layout, "--dry-run"),
        f"{layout}: model.init_from: {weights}: tensor "
        "'model.layers.1.mlp.up_proj.weight' has shape [40, 32] but config.json gives it [48, 32] "
        "(the weights are not those of config.json: save the model again with save_pretrained)",
    )
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights)
    assert_one_error_line(
        invoke_cli(layout, "--dry-run"),
        f"{layout}: model.init_from: {weights}: no tensor "
        "'model.layers.1.mlp.up_proj.weight', which config.json's llama model has (save the model "
        "again with save_pretrained)",
    )


@pytest.mark.parametrize("value,what", [(float("nan"), "NaN values"), (float("inf"), "infinite values")])
def test_a_weight_that_is_not_finite_is_named_before_any_rank_starts(value, what, tmp_path):
    """Before this check a NaN weight showed only as 'training diverged at step 1'."""
    from safetensors.torch import load_file, save_file

    tiny_hf_model("gpt2", tmp_path / "hf")
    weights = tmp_path / "hf" / hf_names.WEIGHTS
    tensors = load_file(weights)
    key = "transformer.h.1.attn.c_attn.weight"
    tensors[key][5, 70] = value  # a value column: our layers.1.attn.wv
    save_file(tensors, weights)
    layout = tmp_path / "layout.toml"
    layout.write_text(hf_layout_text(lines("gpt2"), tmp_path / "hf"))
    assert invoke_cli(layout, "--dry-run").exit_code == 0  # shapes are right: only reading the values finds it
    assert_one_error_line(
        invoke_cli(layout, "--quiet"),
        f"{layout}: model.init_from: {weights}: tensor '{key}' holds "
        f"{what} (start from a model whose weights are all finite)",
    )
    lay = layout_mod.load(layout)  # a rank reading its slices (hetero-launch --rank R, started by hand) finds it too
    with pytest.raises(LayoutError) as e:
        hf.load_shards(lay.model, full_shards(lay.model))
    assert (
        str(e.value) == f"{weights}: model.init_from: tensor '{key}' holds {what} (start from a model whose "
        "weights are all finite)"
    )
    from hetero_llm.model.params import all_params, shard_range  # a rank whose slice misses the value reads on

    wk = [(info, *shard_range(info, 1, 0)) for info in all_params(lay.model) if info.name == "layers.1.attn.wk"]
    assert torch.isfinite(hf.load_shards(lay.model, wk)["layers.1.attn.wk"]).all()
