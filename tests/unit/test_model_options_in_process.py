"""The tests of tests/integration/test_model_options.py that run in this process (the unit tier).

Model options that reproduce Llama- and GPT-2-style models (grouped-query attention, tied embeddings,
biases, norm epsilon, RoPE base) keep layout invariance: TP stages and several pipelines train the same
model as one process. Their effect on the math is checked against transformers in tests/unit/test_hf.py."""

from __future__ import annotations

from harness import LAYOUTS, common_sections
from hetero_llm import layout as layout_mod
from hetero_llm.model.params import all_params

BASE = common_sections(LAYOUTS / "reference" / "reference.toml")  # 6 layers, hidden 32, 4 heads, rope/rmsnorm/swiglu

LLAMA = BASE.replace(
    'position = "rope"',
    'position = "rope"\nkv_heads = 2\ntie_embeddings = true\nrope_theta = 500000.0\nnorm_eps = 1e-6',
)

GPT2 = (
    BASE.replace('mlp = "swiglu"', 'mlp = "gelu"')
    .replace('norm = "rmsnorm"', 'norm = "layernorm"')
    .replace('position = "rope"', 'position = "learned"\nbias = true\ntie_embeddings = true')
)


def _model(common: str) -> layout_mod.ModelSpec:
    text = (
        common + '[cluster]\n[[cluster.nodes]]\nname = "n"\n[[pipelines]]\nbatch = 12\nmicrobatches = 1\n'
        '[[pipelines.stages]]\nlayers = 6\ndevices = ["n:0"]\n'
    )
    return layout_mod.loads(text).model


def test_options_change_the_parameters():
    shapes = {p.name: p.shape for p in all_params(_model(LLAMA))}
    assert "lm_head.weight" not in shapes and shapes["embed.tok"] == (64, 32)  # tied: the head is embed.tok
    assert shapes["layers.0.attn.wq"] == (32, 32) and shapes["layers.0.attn.wk"] == (16, 32)  # 2 of 4 heads of 8
    assert not any(".b" in n.rsplit(".", 1)[-1][:2] for n in shapes)
    gpt2 = {p.name: p for p in all_params(_model(GPT2))}
    assert {n.rsplit(".", 1)[-1] for n in gpt2 if n.startswith("layers.0.")} >= {"bq", "bk", "bv", "bo", "b1", "b2"}
    assert gpt2["layers.0.attn.bq"].shard_dim == 0 and gpt2["layers.0.attn.bo"].shard_dim is None
