"""Hugging Face interop against transformers itself: tiny Llama and GPT-2 models built locally (never a hub
download) load into our model with the same logits and loss, ours export to models transformers loads with
the same logits, and HF -> train 2 steps on a TP + pipeline layout -> hetero-export -> HF gives the model
that the same 2 steps in one process give."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch", reason="the interop needs torch (a core dependency: always there, CI included)")

transformers = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")

from click.testing import CliRunner
from helpers_hf import MODELS, RTOL, SEQ, VOCAB, load_model, make_hf, our_logits, rel

from hetero_llm import layout as layout_mod
from hetero_llm.cli.export import main as export_main
from hetero_llm.interop import hf, hf_names
from hetero_llm.model.forward import init_full, token_loss_sum
from hetero_llm.model.params import all_params, shard_range


def full(model) -> list:
    return [(info, *shard_range(info, 1, 0)) for info in all_params(model)]


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
