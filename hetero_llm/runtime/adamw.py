"""AdamW for CPU ranks, with the exact update of ``torch.optim.AdamW`` (foreach form).

Why not torch's on CPU: its first ``step``/constructor call imports ``torch._dynamo`` (about 2.6 s
of CPU per process), which dominated short multi-rank CPU runs and the test suite. CUDA ranks use
``torch.optim.AdamW(fused=True)``. The update is elementwise, so sharding never changes it.
"""

from __future__ import annotations

import math

import torch


class AdamW:
    """Decoupled weight decay Adam over ``param_groups`` (each: params, lr, weight_decay)."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float):
        self.param_groups = [{"lr": lr, **g, "params": list(g["params"])} for g in groups]
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.steps = 0
        # Keyed by parameter with torch.optim.AdamW's names, so a checkpoint reads and writes both alike.
        self.state = {
            p: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            for g in self.param_groups
            for p in g["params"]
        }

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        bias1 = 1 - self.beta1**self.steps
        bias2_sqrt = math.sqrt(1 - self.beta2**self.steps)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            m = [self.state[p]["exp_avg"] for p in params]
            v = [self.state[p]["exp_avg_sq"] for p in params]
            grads = [p.grad for p in params]
            lr = group["lr"]
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            torch._foreach_lerp_(m, grads, 1 - self.beta1)
            torch._foreach_mul_(v, self.beta2)
            torch._foreach_addcmul_(v, grads, grads, 1 - self.beta2)
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, bias2_sqrt)
            torch._foreach_add_(denom, self.eps)
            torch._foreach_addcdiv_(params, m, denom, -lr / bias1)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
