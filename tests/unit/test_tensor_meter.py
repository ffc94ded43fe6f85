"""The tensor meter (runtime/tensor_meter.py) on a case whose bytes are known: one weight, one batch."""

from __future__ import annotations

import json

import torch

from hetero_llm.runtime.tensor_meter import TensorMeter


def test_the_meter_counts_state_gradients_and_saved_activations_each_storage_once(tmp_path):
    w = torch.zeros(4, 8, requires_grad=True)  # 128 bytes
    x = torch.ones(16, 4)  # 256 bytes, saved by the matmul for w's gradient (w is not needed: x needs none)
    meter = TensorMeter()
    meter.register("parameters", lambda: [w])
    meter.checkpoint()
    assert meter.peak == 128 and meter.at_peak == {"parameters": 128, "gradients": 0, "activations": 0}
    for _ in range(2):
        with meter.saving():
            z = torch.tanh(x @ w)  # tanh saves its output: 16 x 8 floats, 512 bytes
            loss = (z * z).sum()  # the product saves z twice: one storage, counted once
        assert meter.activations == 256 + 512
        loss.backward()  # autograd frees what it saved
        assert meter.activations == 0
        meter.checkpoint()
    assert meter.at_peak == {"parameters": 128, "gradients": 128, "activations": 768}
    assert meter.peak == 1024 and meter.checkpoints == 3
    with meter.saving():
        loss = torch.tanh(x @ w).sum()
    assert meter.activations == 768
    del loss  # a graph dropped without a backward releases its saved tensors too
    assert meter.activations == 0
    meter.write(tmp_path, 3)
    assert json.loads((tmp_path / "rank3.json").read_text())["peak_bytes"] == 1024
    assert [p.name for p in tmp_path.iterdir()] == ["rank3.json"]  # written whole: no temporary left


def test_a_parameter_saved_for_backward_is_state_not_an_activation():
    w = torch.zeros(4, 8, requires_grad=True)
    x = torch.ones(16, 4, requires_grad=True)  # now the matmul saves w too (for x's gradient)
    meter = TensorMeter()
    meter.register("parameters", lambda: [w])
    meter.checkpoint()
    with meter.saving():
        y = x @ w
    assert meter.activations == 256  # x only: w's storage is counted as a parameter
    del y


def test_an_instant_checkpoint_counts_what_is_held_now_and_a_split_backwards_put_off_tensors():
    """After each compute action the runtime checkpoints what is held then: a backward that frees its activations
    while it puts off (or makes) gradients is counted with those beside what is left, not beside the activations
    it freed; the inputs and output gradients a split backward holds for its W are state until the W."""
    from hetero_llm.runtime.wgrad import WeightGradStore

    w = torch.zeros(8, 4, requires_grad=True)  # 128 bytes
    x = torch.ones(16, 4)  # 256 bytes: saved by the linear, then held for its put-off weight gradient
    store = WeightGradStore()
    meter = TensorMeter()
    meter.register("parameters", lambda: [w])
    meter.register("put-off weight gradients", store.held)
    meter.checkpoint(instant=True)
    with meter.saving():
        z = torch.tanh(store.linear(x, w))  # (16, 8); tanh saves its output: 512 bytes
    meter.checkpoint(instant=True)  # the forward's end: x and z saved
    assert meter.peak == 128 + 256 + 512 and meter.at_peak["activations"] == 768
    with store.capturing("mb0"):
        z.sum().backward()  # I: x and the linear's output gradient (16 x 8 floats) put off, the graph freed
    assert w.grad is None and meter.activations == 0
    meter.checkpoint(instant=True)
    assert meter.state_bytes()["put-off weight gradients"] == 256 + 512
    assert (
        meter.peak == 128 + 256 + 512
    )  # not + 768: the put-off tensors and the freed activations were not held at once
    store.flush("mb0")  # W
    meter.checkpoint(instant=True)
    assert meter.state_bytes() == {"parameters": 128, "put-off weight gradients": 0, "gradients": 128}
    assert meter.checkpoints == 4
