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
from helpers_precision import BF16_LOSS_RTOL, BF16_TENSOR_RTOL, assert_bf16_close

import hetero_llm.model.forward as model_mod
from harness import LAYOUTS, RTOL, assert_same_model, common_sections, launch, write_layout
from hetero_llm import layout as layout_mod
from hetero_llm.comm import collectives
from hetero_llm.model.forward import TP, Compute, StageShape, init_full, make_block_fn, stage_forward, token_loss_sum
from hetero_llm.model.params import all_params
from hetero_llm.plan import compile_plan
from hetero_llm.train.loop import stage_compute

REFERENCE = LAYOUTS / "reference" / "reference.toml"
COMMON = common_sections(REFERENCE)  # 6 layers, hidden 32, 4 heads, rmsnorm, rope, swiglu
MODEL = layout_mod.load(REFERENCE).model
GPT = layout_mod.ModelSpec(layers=3, hidden=32, heads=4, vocab=64, seq_len=16)  # layernorm, learned, gelu


# ------------------------------------------------------------------------------------------
# The model functions, one process


def _params(model: layout_mod.ModelSpec) -> dict[str, torch.Tensor]:
    return {info.name: init_full(info, model, seed=7).requires_grad_() for info in all_params(model)}


def _batch(model: layout_mod.ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab, (4, model.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _step(model, compute: Compute, tp: TP = model_mod.NO_TP):
    """Loss and gradients of the whole model as one stage under ``compute``."""
    p = _params(model)
    inputs, targets = _batch(model)
    logits = stage_forward(
        p, inputs, StageShape(0, model.layers, True, True), model, tp, compute, make_block_fn(model, tp, compute)
    )
    loss = token_loss_sum(logits, targets)
    loss.backward()
    return logits, loss.detach(), p


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


# ------------------------------------------------------------------------------------------
# Whole runs (hetero-launch, gloo, CPU)


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
