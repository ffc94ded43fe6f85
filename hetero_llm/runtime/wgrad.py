"""Zero-bubble weight-gradient deferral, beside the runtime that uses it (``WeightGradStore``).

A split backward's ``I`` leaves its linear layers' weight gradients for its ``W``. The model stays
pure tensor code: its layers take any ``forward.Linear``, and a stage whose backwards split passes
this store's.
"""

from __future__ import annotations

import contextlib

import torch


class WeightGradStore:
    """Weight gradients of linear layers put off from an input-gradient pass to a weight pass.

    Zero-bubble schedules split a backward in two: ``I`` computes the input gradient, which the
    previous stage waits for, and ``W`` the weight gradient, which nobody waits for. A stage built with
    this store's ``linear`` runs ``I`` as ordinary autograd inside ``capturing(key)``: each linear
    layer's backward then computes its input gradient and leaves (weight, input, output gradient)
    here instead of its weight gradient; ``flush(key)`` (the ``W``) turns them into weight gradients
    and accumulates them into ``.grad`` as autograd would. Outside ``capturing`` (a full backward) the
    linear layers compute both at once. Norm weights and embeddings are cheap and get theirs in ``I``.
    Holding the inputs and output gradients until ``W`` is the memory a split backward costs.
    """

    def __init__(self) -> None:
        self._capture: list | None = None
        self._pending: dict[object, list] = {}

    @contextlib.contextmanager
    def capturing(self, key: object):
        """Put off the weight gradients of the backward run inside, under ``key`` (e.g. (mb, chunk))."""
        self._capture = self._pending.setdefault(key, [])
        try:
            yield
        finally:
            self._capture = None

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` in x's dtype (a ``Linear``) whose weight gradient this store may put off."""
        return _DeferrableLinear.apply(x, w, self)

    @torch.no_grad()
    def flush(self, key: object) -> None:
        """Compute the weight gradients put off under ``key`` and add them to the weights' ``.grad``."""
        for w, x, g in self._pending.pop(key, ()):
            grad = _weight_grad(x, g).to(w.dtype)
            if w.grad is None:
                w.grad = grad
            else:
                w.grad += grad

    def held(self) -> list[torch.Tensor]:
        """The inputs and output gradients held for the weight gradients put off (outside autograd)."""
        return [t.detach() for entries in self._pending.values() for _, x, g in entries for t in (x, g)]

    @property
    def pending(self) -> list:
        """Keys whose weight gradients are still put off."""
        return list(self._pending)


def _weight_grad(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """d(x @ w.T)/dw for output gradient g: the sum over every row of g and x, (out, in)."""
    return g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, store):
        cast = w.to(x.dtype)
        ctx.save_for_backward(x, cast)
        ctx.weight, ctx.store = w, store
        return x @ cast.T

    @staticmethod
    def backward(ctx, g):
        x, cast = ctx.saved_tensors
        grad_x = g @ cast if ctx.needs_input_grad[0] else None
        capture = ctx.store._capture
        if capture is not None:
            capture.append((ctx.weight, x, g))
            return grad_x, None, None
        return grad_x, _weight_grad(x, g).to(ctx.weight.dtype), None
