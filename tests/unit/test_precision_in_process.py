"""The tests of tests/integration/test_precision.py that run in this process (the unit tier).

bf16 compute from float32 master weights, activation recomputation, compiled blocks.

First the model functions in one process (dtypes, exactness of recomputation, one compiled graph for
every block), then whole runs through ``hetero-launch`` (gloo, CPU): bf16 layouts against the
float32 single-process run within the bf16 tolerance, recomputation inside a layout at 1e-5.

The bf16 tolerance (``train.precision`` documents it too). bf16 rounds every matmul input to 8
bits of mantissa, so a bf16 run is compared with the float32 run of the same model, data and seed,
and layouts in bf16 agree with it (and with one another) only this far:

- per-step loss within ``BF16_LOSS_RTOL`` (1e-2) relative;
- per-step global gradient norm within ``BF16_GRAD_NORM_RTOL`` (5e-2) relative;
- final parameters within ``BF16_PARAM_RTOL`` (1e-2) relative L2 over the whole model, and within
  ``BF16_TENSOR_RTOL`` (1e-1) in each tensor (Adam's first steps are ~lr * sign(g): elements whose
  gradient is near 0 turn bf16 rounding into lr-sized differences, as float32 rounding does at 1e-5).

Measured on layouts/reference/reference.toml (4 steps, CPU): loss 2.5e-5, gradient norm 7e-4, parameters
1.6e-3 (worst tensor 2.1e-2), for one process and for 3-stage TP [1, 2, 1] and 2-pipeline dynamic
layouts alike. A layout bug (a block never synced) moves a tensor by far more than 1e-1.
"""

from __future__ import annotations

import pytest
import torch
from helpers_precision import BF16_LOSS_RTOL, BF16_TENSOR_RTOL
from helpers_precision_common import _params, _step

from harness import LAYOUTS
from hetero_llm import layout as layout_mod
from hetero_llm.model.forward import Compute, StageShape, stage_forward
from hetero_llm.plan import compile_plan
from hetero_llm.train.loop import stage_compute

REFERENCE = LAYOUTS / "reference" / "reference.toml"

MODEL = layout_mod.load(REFERENCE).model

GPT = layout_mod.ModelSpec(layers=3, hidden=32, heads=4, vocab=64, seq_len=16)  # layernorm, learned, gelu


@pytest.mark.parametrize("model", [MODEL, GPT], ids=["llama-style", "gpt-style"])
def test_bf16_computes_in_bf16_from_float32_leaves(model):
    logits, loss, p = _step(model, Compute(torch.bfloat16))
    assert logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32  # token_loss_sum upcasts the logits
    for name, t in p.items():
        assert t.dtype == torch.float32 and t.is_leaf, name
        assert t.grad is not None and t.grad.dtype == torch.float32, name  # accumulated in float32


def test_bf16_middle_stage_keeps_received_dtype():
    p = _params(MODEL)
    x = torch.randn(2, MODEL.seq_len, MODEL.hidden, dtype=torch.bfloat16, requires_grad=True)
    out = stage_forward(p, x, StageShape(2, 4, False, False), MODEL, compute=Compute(torch.bfloat16))
    assert out.dtype == torch.bfloat16  # what the next stage's receive buffer expects
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16  # the gradient sent back travels in bf16 too
    assert p["layers.2.attn.wq"].grad.dtype == torch.float32


@pytest.mark.parametrize("model", [MODEL, GPT], ids=["llama-style", "gpt-style"])
def test_bf16_is_close_to_float32(model):
    _, loss32, p32 = _step(model, Compute())
    _, loss16, p16 = _step(model, Compute(torch.bfloat16))
    assert abs(float(loss16) - float(loss32)) <= BF16_LOSS_RTOL * abs(float(loss32))
    for name in p32:
        g32, g16 = p32[name].grad, p16[name].grad
        assert float((g16 - g32).norm() / g32.norm()) <= BF16_TENSOR_RTOL, name


def _grad_fns(t: torch.Tensor) -> set[str]:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo += [f for f, _ in fn.next_functions]
    return names


def test_float32_path_has_no_casts_or_copies_of_weights():
    """In float32 the casts are no-ops: no copy nodes, no concatenated weights (same graph as before)."""
    logits, _, _ = _step(MODEL, Compute())
    names = _grad_fns(logits)
    assert not any(n.startswith(("ToCopyBackward", "CatBackward")) for n in names), sorted(names)
    bf16_names = _grad_fns(_step(MODEL, Compute(torch.bfloat16))[0])
    assert any(n.startswith("CatBackward") for n in bf16_names)  # bf16: one GEMM for q, k, v


def test_stage_compute_reads_the_layout():
    text = REFERENCE.read_text()
    text = text.replace("[train]\n", '[train]\nprecision = "bf16"\nrecompute = "full"\ncompile = "blocks"\n')
    text = text.replace('devices = ["cpu"]', 'devices = ["cpu", "cpu"]')
    text = text.replace(
        'layers = 6\ndevices = ["node0:0"]',
        'layers = 2\ndevices = ["node0:0"]\nrecompute = "none"\n[[pipelines.stages]]\nlayers = 4\n'
        'devices = ["node0:1"]',
    )
    plan = compile_plan(layout_mod.loads(text))
    cpu = torch.device("cpu")
    stage_says_none, train_default = plan.rank_plan(0), plan.rank_plan(1)
    assert stage_compute(stage_says_none, cpu) == Compute(torch.bfloat16, recompute=False, compile=True)
    assert stage_compute(train_default, cpu) == Compute(torch.bfloat16, recompute=True, compile=True)
    default = compile_plan(layout_mod.load(REFERENCE))
    assert stage_compute(default.rank_plan(0), cpu) == Compute()
