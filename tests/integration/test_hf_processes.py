"""The tests of tests/unit/test_hf.py that start processes or train for real (the integration tier).

Hugging Face interop against transformers itself: tiny Llama and GPT-2 models built locally (never a hub
download) load into our model with the same logits and loss, ours export to models transformers loads with
the same logits, and HF -> train 2 steps on a TP + pipeline layout -> hetero-export -> HF gives the model
that the same 2 steps in one process give."""

from __future__ import annotations

import shutil

import attrs
import pytest

torch = pytest.importorskip("torch", reason="the interop needs torch (a core dependency: always there, CI included)")

transformers = pytest.importorskip("transformers", reason="the 'test' extra installs transformers")

from click.testing import CliRunner
from helpers_hf import LAYERS, RTOL, SEQ, VOCAB, load_model, make_hf, model_lines, our_logits, rel

from harness import assert_same_model, launch, write_layout
from hetero_llm.checkpoint.shards import load_full_params
from hetero_llm.cli.export import main as export_main

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
