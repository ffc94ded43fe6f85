"""The tests of tests/unit/test_domains.py that start processes or train for real (the integration tier).

NIC domains (Holmes): the layout schema, which transport every plan group gets, and the environment
each rank creates a group under. Pure and single-process (the CuPy test needs CUDA and CuPy).

Rule under test: a group whose members are all in one domain uses that domain's transport; a group
spanning domains uses the cross-domain network; without declared domains every group uses the defaults.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest


def _cuda_and_cupy() -> tuple[bool, str]:
    try:
        import cupy  # noqa: F401
        import torch
        from cupy.cuda import nccl  # noqa: F401
    except ImportError:
        return False, "needs CUDA and CuPy; runs on a GPU machine (CuPy is not installed here)"
    if not torch.cuda.is_available():
        return False, "needs CUDA and CuPy; runs on a GPU machine (no CUDA device here)"
    return True, ""


@pytest.mark.gpu
def test_cupy_group_sums_a_torch_tensor_by_pointer():
    """A one-rank CuPy NCCL communicator (one GPU is enough) sums in place on torch's stream."""
    ok, why = _cuda_and_cupy()
    if not ok:
        pytest.skip(why)
    import torch
    import torch.distributed as dist

    from hetero_llm.comm import groups

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    before = os.environ.get("NCCL_NET")
    group = groups.make_cupy_group(store, "grad_sync[0]", (0,), 0, {"NCCL_NET": "Socket"})
    assert os.environ.get("NCCL_NET") == before  # set only while NCCL created the communicator
    x = torch.arange(10, dtype=torch.float32, device="cuda")
    group.all_reduce(x)
    torch.cuda.synchronize()
    assert torch.equal(x.cpu(), torch.arange(10, dtype=torch.float32))
