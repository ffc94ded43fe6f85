"""Hugging Face interop against transformers itself: tiny Llama and GPT-2 models built locally (never a hub
download) load into our model with the same logits and loss, ours export to models transformers loads with
the same logits, and HF -> train 2 steps on a TP + pipeline layout -> hetero-export -> HF gives the model
that the same 2 steps in one process give."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import attrs
import pytest

torch = pytest.importorskip("torch", reason="the interop needs torch (a core dependency: always there, CI included)")
transformers = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")

from click.testing import CliRunner

from harness import assert_same_model, launch, write_layout
from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint.shards import load_full_params
from hetero_llm.cli.export import main as export_main
from hetero_llm.interop import hf, hf_names
from hetero_llm.model.forward import StageShape, init_full, stage_forward, token_loss_sum
from hetero_llm.model.params import all_params, shard_range

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


def full(model) -> list:
    return [(info, *shard_range(info, 1, 0)) for info in all_params(model)]


def our_logits(params, model, ids):
    return stage_forward(params, ids, StageShape(0, model.layers, True, True), model)


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_loads_with_its_logits_and_loss(name, tmp_path):
    theirs = make_hf(name, tmp_path / "hf")
    model = load_model(name, tmp_path / "hf")
    params = hf.load_shards(model, full(model))
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = theirs(ids, labels=ids)
        logits = our_logits(params, model, ids)
    assert rel(logits, out.logits) <= RTOL
    loss = token_loss_sum(logits[:, :-1], ids[:, 1:]) / ids[:, 1:].numel()
    assert abs(float(loss) - float(out.loss)) <= RTOL * float(out.loss)


@pytest.mark.parametrize("name,tp", [("llama-gqa-tied-bias-theta", 2), ("llama", 4), ("gpt2", 2), ("gpt2", 4)])
def test_each_rank_reads_its_slices(name, tp, tmp_path):
    """TP shards read from the file (permuted per head, transposed from Conv1D) are slices of the full tensors."""
    make_hf(name, tmp_path / "hf")
    model = load_model(name, tmp_path / "hf")
    whole = hf.load_shards(model, full(model))
    for index in range(tp):
        shards = [(info, *shard_range(info, tp, index)) for info in all_params(model)]
        for (info, lo, hi), got in zip(shards, hf.load_shards(model, shards).values()):
            want = whole[info.name] if info.shard_dim is None else whole[info.name].narrow(info.shard_dim, lo, hi - lo)
            assert torch.equal(got, want), f"{info.name} tp {index}/{tp}"


@pytest.mark.parametrize("name", list(MODELS))
def test_export_loads_in_transformers(name, tmp_path):
    model = load_model(name)
    params = {info.name: init_full(info, model, seed=3) + 0.01 * torch.randn(info.shape) for info in all_params(model)}
    hf.export(params, model, tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == ("LlamaForCausalLM" if name.startswith("llama") else "GPT2LMHeadModel")
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(our_logits(params, model, ids), loaded(ids).logits) <= RTOL


def test_export_refuses_a_model_transformers_has_no_class_for(tmp_path):
    step = tmp_path / "ckpt" / "step-000001"
    step.mkdir(parents=True)
    (step / "rank0.pt").write_bytes(b"")
    model = layout_mod.spec_dict(load_model("llama"))
    model["norm"] = "layernorm"  # layernorm + rope + swiglu: neither Llama nor GPT-2
    (step / "meta.json").write_text(
        json.dumps({"step": 1, "world_size": 1, "layout": "x.toml", "params": {}, "model": model})
    )
    result = CliRunner().invoke(export_main, [str(tmp_path / "ckpt"), "--hf", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.output == (
        f"error: {step}: CHECKPOINT_DIR: [model] norm 'layernorm', position 'rope', mlp 'swiglu' "
        "matches neither Llama (norm 'rmsnorm', position 'rope', mlp 'swiglu') nor GPT-2 (norm "
        "'layernorm', position 'learned', mlp 'gelu', no kv_heads): transformers has no class for "
        "it (train with one of those to export)\n"
    )
    assert not (tmp_path / "out").exists()


def test_export_of_a_folder_that_is_no_checkpoint(tmp_path):
    result = CliRunner().invoke(export_main, [str(tmp_path), "--hf", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.output.startswith(f"error: {tmp_path}: CHECKPOINT_DIR: no complete checkpoint here")


TRAIN = """
[train]
steps = 2
global_batch = 12
seed = 5
lr = 3e-3
warmup_steps = 0
schedule = "1f1b"

[data]
kind = "grammar"
grammar_vocab = 64
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "name,pipelines",
    [
        ("llama-gqa-tied-bias-theta", [(8, 4, [(1, 2), (1, 1)]), (4, 2, [(2, 2)])]),
        ("gpt2", [(12, 3, [(1, 1), (1, 2)])]),
    ],
    ids=["llama gqa tied: tp [[2, 1], [2]]", "gpt2: tp [1, 2]"],
)
def test_round_trip_through_training(name, pipelines, tmp_path):
    make_hf(name, tmp_path / "hf")
    common = model_lines(name) + f'init_from = "{tmp_path / "hf"}"\n' + TRAIN
    runs = {}
    for label, pipes in (("one", [(12, 3, [(LAYERS, 1)])]), ("many", pipelines)):
        (tmp_path / label).mkdir()
        runs[label] = launch(write_layout(tmp_path / label / "layout.toml", common, pipes), tmp_path / label)
        result = CliRunner().invoke(
            export_main, [str(tmp_path / label / "ckpt"), "--hf", str(tmp_path / f"{label}-hf")]
        )
        assert result.exit_code == 0, result.output
    if name.startswith("gpt2"):
        # Without RoPE a key bias adds q.b to every score of a query alike, and softmax ignores that: its
        # gradient is zero in exact arithmetic, so Adam's update of it (g / sqrt(v)) is rounding noise, as in
        # transformers itself. Compared are the losses, grad norms and every other tensor.
        runs = {
            k: attrs.evolve(r, params={n: t for n, t in r.params.items() if not n.endswith(".attn.bk")})
            for k, r in runs.items()
        }
    assert_same_model(runs["many"], runs["one"])
    model = load_model(name)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    start = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "many-hf")
    with torch.no_grad():
        one_process = our_logits(load_full_params(str(tmp_path / "one" / "ckpt")), model, ids)
        assert rel(trained(ids).logits, one_process) <= RTOL
        assert rel(start(ids).logits, one_process) > 100 * RTOL  # the 2 steps did train
    shutil.rmtree(tmp_path / "hf")


@pytest.mark.parametrize(
    "command,args,expected",
    [
        (export_main, ["ckpt"], "Missing option '--hf' (see hetero-export --help)"),
        ("generate", ["ckpt"], "Missing option '--prompt' (see hetero-generate --help)"),
        ("tokenize", ["in.txt", "-o"], "Option '-o' requires an argument (see hetero-tokenize --help)"),
    ],
)
def test_usage_errors_are_one_line(command, args, expected):
    import importlib

    main = command if callable(command) else importlib.import_module(f"hetero_llm.cli.{command}").main
    result = CliRunner().invoke(main, args)
    assert (result.exit_code, result.output) == (2, f"error: {expected}\n")


def test_hub_style_gpt2_names_and_sharded_files(tmp_path):
    """The hub's GPT-2 file names tensors without 'transformer.' (saved from GPT2Model), and large models
    come as several safetensors files with a model.safetensors.index.json: both load alike."""
    from safetensors.torch import load_file, save_file

    make_hf("gpt2-tied", tmp_path / "hf")
    model = load_model("gpt2-tied", tmp_path / "hf")
    want = hf.load_shards(model, full(model))
    tensors = load_file(tmp_path / "hf" / hf_names.WEIGHTS)
    (tmp_path / "hf" / hf_names.WEIGHTS).unlink()
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    names = sorted(renamed)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for file, keys in halves.items():
        save_file({k: renamed[k] for k in keys}, tmp_path / "hf" / file)
    (tmp_path / "hf" / hf_names.WEIGHTS_INDEX).write_text(
        json.dumps({"weight_map": {k: file for file, keys in halves.items() for k in keys}})
    )
    got = hf.load_shards(load_model("gpt2-tied", tmp_path / "hf"), full(model))
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
