"""Helpers shared by tests/unit/test_hf.py and tests/integration/test_hf_processes.py; not a test module."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the interop needs torch (a core dependency: always there, CI included)")

transformers = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")


from hetero_llm import layout as layout_mod
from hetero_llm.model.forward import StageShape, stage_forward

RTOL = 1e-5

LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 2, 32, 4, 64, 16

# (id, HF config kwargs, [model] lines): Llama with and without GQA/tied/bias, GPT-2 tied or not.
MODELS = {
    "llama": (
        "llama",
        dict(num_key_value_heads=4, tie_word_embeddings=False, rms_norm_eps=1e-5),
        'norm = "rmsnorm"\nposition = "rope"\nmlp = "swiglu"\nffn = 48',
    ),
    "llama-gqa-tied-bias-theta": (
        "llama",
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_theta=500000.0,
            rms_norm_eps=1e-6,
        ),
        'norm = "rmsnorm"\nposition = "rope"\nmlp = "swiglu"\nffn = 48\nkv_heads = 2\n'
        "tie_embeddings = true\nbias = true\nrope_theta = 500000.0\nnorm_eps = 1e-6",
    ),
    "gpt2": ("gpt2", dict(tie_word_embeddings=False, n_positions=32), "bias = true"),
    "gpt2-tied": ("gpt2", dict(tie_word_embeddings=True, n_positions=SEQ), "bias = true\ntie_embeddings = true"),
}


def make_hf(name: str, folder: Path, seed: int = 0):
    """A tiny HF model with every parameter (norms and biases too) away from its default init, saved in ``folder``."""
    kind, kwargs, _ = MODELS[name]
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=48,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=SEQ,
            **kwargs,
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            bos_token_id=0,
            eos_token_id=0,
            attn_pdrop=0.0,
            embd_pdrop=0.0,
            resid_pdrop=0.0,
            **kwargs,
        )
        model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    model.save_pretrained(folder)
    return model


def model_lines(name: str, layers: int = LAYERS) -> str:
    return (
        f"[model]\nlayers = {layers}\nhidden = {HIDDEN}\nheads = {HEADS}\nvocab = {VOCAB}\nseq_len = {SEQ}\n"
        f"{MODELS[name][2]}\n"
    )


def load_model(name: str, init_from: Path | None = None) -> layout_mod.ModelSpec:
    text = (
        model_lines(name)
        + (f'init_from = "{init_from}"\n' if init_from else "")
        + '[train]\nsteps = 1\nglobal_batch = 1\n[cluster]\n[[cluster.nodes]]\nname = "n"\n[[pipelines]]\nbatch = 1\n'
        f'microbatches = 1\n[[pipelines.stages]]\nlayers = {LAYERS}\ndevices = ["n:0"]\n'
    )
    return layout_mod.loads(text).model


def our_logits(params, model, ids):
    return stage_forward(params, ids, StageShape(0, model.layers, True, True), model)


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())
