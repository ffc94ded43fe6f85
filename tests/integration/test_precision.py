"""bf16 compute from float32 master weights, activation recomputation, compiled blocks.

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
import torch.distributed as dist
from helpers_precision import assert_bf16_close
from helpers_precision_common import _step

import hetero_llm.model.forward as model_mod
from harness import LAYOUTS, RTOL, assert_same_model, common_sections, launch, write_layout
from hetero_llm import layout as layout_mod
from hetero_llm.comm import collectives
from hetero_llm.model.forward import TP, Compute

REFERENCE = LAYOUTS / "reference" / "reference.toml"

COMMON = common_sections(REFERENCE)  # 6 layers, hidden 32, 4 heads, rmsnorm, rope, swiglu

MODEL = layout_mod.load(REFERENCE).model


def _saved_bytes(model, compute: Compute) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _step(model, compute)
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_recompute_is_exact_and_saves_less(dtype):
    logits, loss, p = _step(MODEL, Compute(dtype))
    logits_rc, loss_rc, p_rc = _step(MODEL, Compute(dtype, recompute=True))
    assert torch.equal(logits, logits_rc) and torch.equal(loss, loss_rc)
    for name in p:
        assert torch.equal(p[name].grad, p_rc[name].grad), name
    # Only block inputs (and embedding / head tensors) are kept: far less than every activation.
    assert _saved_bytes(MODEL, Compute(dtype, recompute=True)) < 0.5 * _saved_bytes(MODEL, Compute(dtype))


@pytest.fixture
def counted_compile(monkeypatch):
    """torch.compile with a backend that counts the graphs it is given and runs them as traced."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real = torch.compile
    monkeypatch.setattr(model_mod.torch, "compile", lambda fn, **kw: real(fn, backend=backend, **kw))
    torch._dynamo.reset()
    yield graphs
    torch._dynamo.reset()


@pytest.mark.parametrize("recompute", [False, True], ids=["no-recompute", "recompute"])
def test_compiled_blocks_match_eager_with_one_graph_for_all_blocks(counted_compile, recompute):
    logits, loss, p = _step(MODEL, Compute(recompute=recompute))
    logits_c, loss_c, p_c = _step(MODEL, Compute(recompute=recompute, compile=True))
    assert len(counted_compile) == 1, f"{len(counted_compile)} graphs for {MODEL.layers} blocks (expected one, reused)"
    assert torch.allclose(logits_c, logits, rtol=1e-5, atol=1e-6)
    for name in p:
        assert torch.allclose(p_c[name].grad, p[name].grad, rtol=1e-4, atol=1e-7), name


def test_compiled_blocks_run_tp_collectives_eagerly(counted_compile):
    """The real TP operators (c10d all-reduces) inside compiled blocks, on a one-rank gloo group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        tp = TP(lambda x: collectives._Enter.apply(x, group, None), lambda x: collectives._Exit.apply(x, group, None))
        logits, _, p = _step(MODEL, Compute())
        logits_c, _, p_c = _step(MODEL, Compute(compile=True, recompute=True), tp)
    finally:
        dist.destroy_process_group()
    assert counted_compile, "nothing was compiled"
    assert torch.allclose(logits_c, logits, rtol=1e-5, atol=1e-6)
    for name in p:
        assert torch.allclose(p_c[name].grad, p[name].grad, rtol=1e-4, atol=1e-7), name


@pytest.fixture(scope="module")
def reference(shared_launch):
    return shared_launch(REFERENCE)  # one run for the modules that compare with it (conftest.py)


BF16_CASES = [
    ("one process", [(12, 3, [(6, 1)])], "1f1b"),
    ("tp [1, 2, 1], 1f1b", [(12, 4, [(2, 1), (3, 2), (1, 1)])], "1f1b"),
    ("2 pipelines tp [[1, 2, 1], [1]], dynamic", [(8, 4, [(2, 1), (3, 2), (1, 1)]), (4, 2, [(6, 1)])], "dynamic"),
    ("3 stages tp [1, 2, 1], zbh1", [(12, 4, [(2, 1), (3, 2), (1, 1)])], "zbh1"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,pipelines,schedule", BF16_CASES, ids=[c[0] for c in BF16_CASES])
def test_bf16_layout_trains_the_float32_model_within_bf16_tolerance(name, pipelines, schedule, reference, tmp_path):
    path = write_layout(tmp_path / "layout.toml", COMMON, pipelines, schedule)
    assert_bf16_close(launch(path, tmp_path, "--set", "train.precision=bf16"), reference)


@pytest.mark.multiprocess
def test_recompute_in_a_layout_trains_the_same_model(reference, tmp_path):
    """train.recompute for every stage but one that opts out; float32 layout invariance (1e-5) holds."""
    path = write_layout(tmp_path / "layout.toml", COMMON, [(12, 4, [(2, 1), (3, 2), (1, 1)])])
    run = launch(path, tmp_path, "--set", "train.recompute=full", "--set", "pipelines[0].stages[2].recompute=none")
    assert_same_model(run, reference, RTOL)
