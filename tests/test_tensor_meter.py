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
