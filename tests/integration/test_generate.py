"""hetero-generate: the KV-cached model gives the full model's logits, and greedy decoding equals
transformers.generate on the exported model (tiny models trained a few steps here)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from harness import LAYOUTS, common_sections, launch, write_layout
from hetero_llm.checkpoint.shards import load_full_params
from hetero_llm.cli.generate import main as generate_main
from hetero_llm.interop import export, generate
from hetero_llm.model.forward import StageShape, stage_forward

BASE = (
    common_sections(LAYOUTS / "reference" / "reference.toml")
    .replace("steps = 3", "steps = 4")
    .replace("lr = 1e-3", "lr = 1e-2")
)
MODELS = {
    "llama-gqa-tied": BASE.replace('position = "rope"', 'position = "rope"\nkv_heads = 2\ntie_embeddings = true'),
    "gpt2": (
        BASE.replace('mlp = "swiglu"', 'mlp = "gelu"')
        .replace('norm = "rmsnorm"', 'norm = "layernorm"')
        .replace('position = "rope"', 'position = "learned"\nbias = true')
    ),
}


@pytest.fixture(scope="module", params=list(MODELS))
def trained(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    launch(write_layout(d / "layout.toml", MODELS[request.param], [(12, 3, [(6, 1)])]), d)
    return d / "ckpt"


def test_cached_logits_equal_the_full_model(trained):
    s = export.saved(str(trained))
    params = load_full_params(str(trained))
    ids = torch.randint(0, s.model.vocab, (2, s.model.seq_len), generator=torch.Generator().manual_seed(0))
    full = stage_forward(params, ids, StageShape(0, s.model.layers, True, True), s.model)
    cache = generate.KVCache(s.model.layers)
    pieces = [generate.forward(params, s.model, ids[:, :5], cache)]
    pieces += [generate.forward(params, s.model, ids[:, t : t + 1], cache) for t in range(5, 9)]
    pieces.append(generate.forward(params, s.model, ids[:, 9:], cache))
    cached = torch.cat(pieces, dim=1)
    assert float((cached - full).norm() / full.norm()) <= 1e-5


def test_greedy_equals_transformers_generate(trained, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")
    s = export.saved(str(trained))
    export.export_checkpoint(str(trained), str(tmp_path / "hf"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    prompt = [5, 17, 3, 9]
    ours = generate.generate(load_full_params(str(trained)), s.model, prompt, 10, temperature=0, eos_id=None)
    out = theirs.generate(
        torch.tensor([prompt]),
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    assert out[0, len(prompt) :].tolist() == ours


def test_sampling_is_seeded_and_respects_top_k(trained):
    s = export.saved(str(trained))
    params = load_full_params(str(trained))
    a = generate.generate(params, s.model, [1, 2, 3], 10, temperature=1.0, top_k=3, seed=4)
    assert a == generate.generate(params, s.model, [1, 2, 3], 10, temperature=1.0, top_k=3, seed=4)
    cache = generate.KVCache(s.model.layers)
    logits = generate.forward(params, s.model, torch.tensor([[1, 2, 3] + a[:-1]]), cache)[0, 2:]
    for step, token in enumerate(a):  # every sampled token is among that step's 3 likeliest
        assert token in logits[step].topk(3).indices.tolist()


def test_cli_prints_prompt_and_continuation_and_refuses_bad_prompts(trained):
    """The grammar's tokens are ids: the prompt and the output are ids separated by spaces."""
    step = export.saved(str(trained)).ckpt.path
    result = CliRunner().invoke(
        generate_main, [str(trained), "--prompt", "5 17 3", "--max-new-tokens", "5", "--temperature", "0"]
    )
    assert result.exit_code == 0, result.output
    out = [int(t) for t in result.output.split()]
    assert out[:3] == [5, 17, 3] and len(out) == 8
    for args, message in [
        (
            ["--prompt", "1 2 3", "--max-new-tokens", "14"],
            "--max-new-tokens: 14 tokens after a prompt of 3 exceed "
            "model.seq_len 16, the positions the model was trained on (use at most 13, or a shorter prompt)",
        ),
        (
            ["--prompt", "hello"],
            "--prompt: the model was trained on the embedded grammar, whose tokens are ids, not "
            "text: give ids separated by spaces, e.g. --prompt '3 17 5'",
        ),
        (["--prompt", "1 64"], "--prompt: token 64 is outside the model's vocabulary of 64 (model.vocab)"),
    ]:
        result = CliRunner().invoke(generate_main, [str(trained), *args])
        assert (result.exit_code, result.output) == (2, f"error: {step}: {message}\n")
