"""Our CPU AdamW makes exactly torch.optim.AdamW's update."""

import torch

from hetero_llm.runtime.adamw import AdamW


def test_matches_torch_adamw_over_steps_with_lr_changes():
    gen = torch.Generator().manual_seed(0)
    ours = [torch.randn(7, 5, generator=gen).requires_grad_(), torch.randn(11, generator=gen).requires_grad_()]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    opt = AdamW([{"params": [ours[0]], "weight_decay": 0.1}, {"params": [ours[1]], "weight_decay": 0.0}], **kw)
    torch_opt = torch.optim.AdamW(
        [{"params": [ref[0]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}], **kw
    )
    for step in range(6):
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        for o in (opt, torch_opt):
            for group in o.param_groups:
                group["lr"] = 1e-2 * (step + 1) / 6
        opt.step()
        torch_opt.step()
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    opt.zero_grad()
    assert all(p.grad is None for p in ours)
