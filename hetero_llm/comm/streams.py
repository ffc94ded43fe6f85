"""CUDA streams beside the compute stream, so communication overlaps compute (none on CPU).

Used by stage-boundary p2p (``hetero_llm.comm.p2p``) and gradient sync (``hetero_llm.comm.collectives``).
"""

from __future__ import annotations

import contextlib

import torch


class Streams:
    """Side CUDA streams for communication, so it overlaps compute; on CPU none, and no-ops.

    ``p2p`` carries stage-boundary receives (and the host copies of gloo staging), ``grads`` the
    packing and all-reduce of gradient sync. Every hand-over between streams is explicit: the
    consumer stream waits for the producer (``wait``), and a tensor allocated on one stream and used
    on another is recorded on the user (``hand_over``) so the caching allocator does not reuse its
    memory while that stream may still read it. Tests pass a fake with the same methods to check
    the order of these calls on CPU.
    """

    def __init__(self, device: torch.device):
        self.active = device.type == "cuda"
        cuda = torch.cuda if self.active else None
        self.compute = cuda.current_stream(device) if cuda else None
        self.p2p = cuda.Stream(device) if cuda else None
        self.grads = cuda.Stream(device) if cuda else None

    def use(self, stream) -> contextlib.AbstractContextManager:
        """Make ``stream`` current for the kernels (and NCCL calls) issued inside."""
        return torch.cuda.stream(stream) if self.active else contextlib.nullcontext()

    def wait(self, waiter, producer) -> None:
        """Work issued on ``waiter`` from now on starts after all work issued on ``producer`` so far."""
        if self.active:
            waiter.wait_stream(producer)

    def hand_over(self, tensor: torch.Tensor, stream) -> None:
        if self.active:
            tensor.record_stream(stream)

    def synchronize(self, stream) -> None:
        """Block the host until ``stream`` is done (gloo reads host memory the moment it is called)."""
        if self.active:
            stream.synchronize()


NO_STREAMS = Streams(torch.device("cpu"))
