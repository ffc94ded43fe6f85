"""Zero-bubble schedules: a backward split into input (I) and weight (W) gradients trains the same model.

The split is checked twice: the model functions against plain autograd in one process (same
gradients, weight gradients absent until W), and whole layouts with ``schedule = "zbh1"`` or a
schedule file mixing split and full backwards against the single-process run (float32, 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from harness import LAYOUTS, common_sections, write_layout
from hetero_llm import layout as layout_mod
from hetero_llm.model.forward import Compute, StageShape, init_full, make_block_fn, stage_forward, token_loss_sum
from hetero_llm.model.params import all_params
from hetero_llm.runtime.wgrad import WeightGradStore

REFERENCE = LAYOUTS / "reference" / "reference.toml"

COMMON = common_sections(REFERENCE)  # 6 layers, hidden 32, 4 heads, rmsnorm, rope, swiglu

LLAMA = layout_mod.load(REFERENCE).model

GPT = layout_mod.ModelSpec(layers=3, hidden=32, heads=4, vocab=64, seq_len=16)  # layernorm, learned, gelu

MODELS = pytest.mark.parametrize("model", [LLAMA, GPT], ids=["llama-style", "gpt-style"])

LINEAR_LEAVES = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "lm_head.weight")


def _params(model) -> dict[str, torch.Tensor]:
    return {info.name: init_full(info, model, seed=3).requires_grad_() for info in all_params(model)}


def _microbatch(model, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, model.vocab, (2, model.seq_len + 1), generator=torch.Generator().manual_seed(index))
    return tokens[:, :-1], tokens[:, 1:]


def _loss(p, model, index: int, compute: Compute, linear=None) -> torch.Tensor:
    inputs, targets = _microbatch(model, index)
    kw = {"linear": linear} if linear is not None else {}
    logits = stage_forward(
        p,
        inputs,
        StageShape(0, model.layers, True, True),
        model,
        compute=compute,
        block_fn=make_block_fn(model, compute=compute, **kw),
        **kw,
    )
    return token_loss_sum(logits, targets)


def _is_linear(name: str) -> bool:
    return name.endswith(LINEAR_LEAVES)


@MODELS
@pytest.mark.parametrize(
    "compute", [Compute(), Compute(recompute=True), Compute(torch.bfloat16)], ids=["fp32", "recompute", "bf16"]
)
def test_split_backward_gives_autograds_gradients(model, compute):
    """Two microbatches, I then W each (W of the first after the second's I, as ZB-H1 runs them):
    every gradient equals plain autograd's; before its W a linear weight has no gradient at all."""
    plain = _params(model)
    for index in (0, 1):
        _loss(plain, model, index, compute).backward()

    split = _params(model)
    store = WeightGradStore()
    losses = [_loss(split, model, index, compute, store.linear) for index in (0, 1)]
    with store.capturing(0):
        losses[0].backward()
    for name, t in split.items():  # the input-gradient pass left the linear weights alone
        assert (t.grad is None) == _is_linear(name), name
    with store.capturing(1):
        losses[1].backward()
    assert store.pending == [0, 1]
    store.flush(0)
    store.flush(1)
    assert store.pending == []
    for name, t in split.items():
        want = plain[name].grad
        assert t.grad is not None and t.grad.dtype == torch.float32, name
        if compute.dtype == torch.float32:  # the same products summed in the same order
            assert torch.allclose(t.grad, want, rtol=1e-6, atol=1e-9), name
        else:  # bf16 rounds the weight gradient before the float32 accumulation, as autograd's cast does
            assert float((t.grad - want).norm() / want.norm()) < 2e-2, name


def test_outside_capturing_the_store_computes_weight_gradients_at_once():
    plain, split = _params(GPT), _params(GPT)
    _loss(plain, GPT, 0, Compute()).backward()
    store = WeightGradStore()
    _loss(split, GPT, 0, Compute(), store.linear).backward()  # a full B on a stage whose other backwards split
    assert store.pending == []
    for name in plain:
        assert torch.allclose(split[name].grad, plain[name].grad, rtol=1e-6, atol=1e-9), name


def _one_stage_runner(split: bool):
    """The runtime's StageRunner for a one-stage pipeline (no neighbours: no process group needed)."""
    from hetero_llm.comm.groups import Comms
    from hetero_llm.model.forward import NO_TP
    from hetero_llm.plan import StagePlan
    from hetero_llm.runtime.interpreter import Microbatch, StageRoutes, StageRunner

    comms = Comms(0, torch.device("cpu"), {}, None, (0,))
    params = _params(LLAMA)
    runner = StageRunner(
        comms,
        params,
        StagePlan(0, 0, (0,), ((0, LLAMA.layers),), 1),
        LLAMA,
        NO_TP,
        StageRoutes(None, (), None, ()),
        split_backward=split,
    )
    mbs = [Microbatch(*_microbatch(LLAMA, index)) for index in (0, 1)]
    return runner, params, mbs


def test_runtime_defers_weight_gradients_from_i_to_w():
    from hetero_llm.schedule import parse_actions

    runner, params, mbs = _one_stage_runner(split=True)
    runner._begin(mbs, global_tokens=64)
    for action in parse_actions("F0 I0 F1"):
        runner.execute(action)
    assert [name for name, t in params.items() if t.grad is None] == [n for n in params if _is_linear(n)]
    with pytest.raises(RuntimeError, match=r"weight gradients \[\(0, 0\)\]"):
        runner._finish()  # a W never ran: the step must not end quietly without its weight gradients
    runner.execute(parse_actions("W0")[0])
    assert all(t.grad is not None for t in params.values())

    reference, ref_params, _ = _one_stage_runner(split=False)
    assert reference.run(tuple(parse_actions("F0 B0 F1 B1")), mbs, global_tokens=64) is not None
    split, split_params, _ = _one_stage_runner(split=True)
    split.run(tuple(parse_actions("F0 F1 I0 I1 W1 W0")), mbs, global_tokens=64)
    for name in ref_params:
        assert torch.allclose(split_params[name].grad, ref_params[name].grad, rtol=1e-5, atol=1e-9), name


def test_schedule_file_with_split_backwards_refuses_compile(tmp_path):
    from click.testing import CliRunner

    from hetero_llm.cli.launch import main

    (tmp_path / "order.txt").write_text("F0 I0 W0\n")
    path = write_layout(
        tmp_path / "layout.toml", COMMON.replace("[train]", '[train]\ncompile = "blocks"'), [(12, 1, [(6, 1)])]
    )
    path.write_text(
        path.read_text().replace("microbatches = 1\n", 'microbatches = 1\nschedule_file = "order.txt"\n', 1)
    )
    result = CliRunner().invoke(main, [str(path), "--dry-run"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        f"error: {path}: train.compile: 'blocks' cannot compile a schedule that splits backwards into I and W "
        "(set compile = 'none', or a schedule without I/W actions)"
    )
