"""What one rank holds: its parameter shards with their layout coordinates, and its optimizer."""

from __future__ import annotations

import attrs
import torch

from hetero_llm.layout import TrainSpec
from hetero_llm.model.forward import init_shard
from hetero_llm.plan.rank import RankPlan
from hetero_llm.runtime.adamw import AdamW


@attrs.define
class RankState:
    """What one rank holds: its parameter shards (float32 leaves) and their layout coordinates."""

    params: dict[str, torch.Tensor]
    coords: dict[str, tuple[int | None, int, int, tuple[int, ...]]]  # name -> (shard dim, lo, hi, full shape)
    replicas: dict[str, int]  # name -> copies of this shard inside this rank's pipeline (TP-replicated)
    decay: dict[str, bool]

    def grad(self, name: str) -> torch.Tensor:
        """The gradient of shard ``name``: the step's backward gives every shard one."""
        grad = self.params[name].grad
        assert grad is not None, f"{name} has no gradient: the step's backward did not reach it"
        return grad


def init_state(rp: RankPlan, device: torch.device, initial: dict[str, torch.Tensor] | None = None) -> RankState:
    """The rank's shards: ``initial`` (restored from a checkpoint, or read from model.init_from) where given,
    else initialized from the seed."""
    model, seed = rp.model, rp.train.seed
    params, coords, replicas, decay = {}, {}, {}, {}
    for s in rp.shards:
        shard = initial[s.name] if initial is not None else init_shard(s.info, model, seed, s.lo, s.hi)
        params[s.name] = shard.to(device).requires_grad_()
        coords[s.name] = s.coords
        replicas[s.name] = s.replicas
        decay[s.name] = s.info.decay
    return RankState(params, coords, replicas, decay)


def make_optimizer(state: RankState, train: TrainSpec) -> torch.optim.Optimizer | AdamW:
    names = sorted(state.params)  # same order on every layout
    groups = [
        {"params": [state.params[n] for n in names if state.decay[n]], "weight_decay": train.weight_decay},
        {"params": [state.params[n] for n in names if not state.decay[n]], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if next(iter(state.params.values())).is_cuda:
        return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, fused=True)
    return AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps)
