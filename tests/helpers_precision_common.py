"""Helpers shared by tests/integration/test_precision.py and tests/unit/test_precision_in_process.py; not a test module."""

from __future__ import annotations

import torch

import hetero_llm.model.forward as model_mod
from harness import LAYOUTS
from hetero_llm import layout as layout_mod
from hetero_llm.model.forward import TP, Compute, StageShape, init_full, make_block_fn, stage_forward, token_loss_sum
from hetero_llm.model.params import all_params

REFERENCE = LAYOUTS / "reference" / "reference.toml"

MODEL = layout_mod.load(REFERENCE).model


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
