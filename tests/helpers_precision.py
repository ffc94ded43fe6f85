"""The bf16 tolerance that several test files check runs against (tests/integration/test_precision.py, tests/unit/test_zero1.py,
tests/integration/test_gpu.py); not a test module. tests/integration/test_precision.py's docstring says where the numbers come from.
"""

from __future__ import annotations

import torch

BF16_LOSS_RTOL = 1e-2
BF16_GRAD_NORM_RTOL = 5e-2
BF16_PARAM_RTOL = 1e-2
BF16_TENSOR_RTOL = 1e-1


def assert_bf16_close(run, ref) -> None:
    """``run`` (bf16) trains ``ref``'s model (float32) within the bf16 tolerance (test_precision's docstring)."""
    assert len(run.losses) == len(ref.losses)
    for step, (a, b) in enumerate(zip(run.losses, ref.losses)):
        assert abs(a - b) <= BF16_LOSS_RTOL * abs(b), f"step {step}: loss {a!r} vs float32 {b!r}"
    for step, (a, b) in enumerate(zip(run.grad_norms, ref.grad_norms)):
        assert abs(a - b) <= BF16_GRAD_NORM_RTOL * abs(b), f"step {step}: grad norm {a!r} vs float32 {b!r}"
    assert set(run.params) == set(ref.params)
    diff = ref_sq = 0.0
    for name, want in ref.params.items():
        got = run.params[name]
        assert got.dtype == torch.float32, f"{name}: master weights must stay float32, got {got.dtype}"
        err = float((got - want).norm() / want.norm())
        assert err <= BF16_TENSOR_RTOL, f"{name}: relative error {err:.2e} > {BF16_TENSOR_RTOL:.0e}"
        diff += float((got - want).double().pow(2).sum())
        ref_sq += float(want.double().pow(2).sum())
    assert (diff / ref_sq) ** 0.5 <= BF16_PARAM_RTOL
