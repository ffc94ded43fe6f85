"""The tests of tests/integration/test_gpu.py that run in this process (the unit tier).

The GPU path: CUDA streams for communication, host staging for gloo, and layout invariance on CUDA.

Two parts:

1. CPU-runnable checks of the GPU code paths. The stream logic is checked against a fake
   ``streams.Streams`` that logs every stream hand-over (which stream is current when a receive is
   posted, who waits for whom, which tensor is recorded on which stream); host staging (what gloo
   needs for CUDA tensors) is forced on CPU tensors, both with fake p2p calls and over real gloo.
2. ``@pytest.mark.gpu`` tests, skipped without CUDA: the reference model on CUDA against CPU, and
   layouts of several ranks on the one GPU (backend gloo, p2p staged through host memory) against
   the one-process CUDA run, in float32 (1e-5) and bf16 (the tolerance of tests/integration/test_precision.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

from hetero_llm.comm import collectives, p2p
from hetero_llm.comm.streams import NO_STREAMS, Streams
from hetero_llm.plan import Route
from hetero_llm.plan.rank import GradSyncKey


class FakeStreams(Streams):
    """Streams named "compute", "p2p", "grads" that log what the real ones would do."""

    def __init__(self):
        self.active = True
        self.compute, self.p2p, self.grads = "compute", "p2p", "grads"
        self.log: list[tuple] = []
        self.stack = ["compute"]
        self.recorded: list[tuple[torch.Tensor, str]] = []

    @property
    def current(self) -> str:
        return self.stack[-1]

    @contextlib.contextmanager
    def use(self, stream):
        self.log.append(("use", stream))
        self.stack.append(stream)
        try:
            yield
        finally:
            self.stack.pop()
            self.log.append(("end", stream))

    def wait(self, waiter, producer):
        self.log.append(("wait", waiter, producer))

    def hand_over(self, tensor, stream):
        self.log.append(("hand_over", stream))
        self.recorded.append((tensor, stream))

    def synchronize(self, stream):
        self.log.append(("synchronize", stream))


class FakeWork:
    def __init__(self, streams: FakeStreams, name: str, on_wait=None, gate: threading.Event | None = None):
        self.streams, self.name, self.on_wait, self.gate = streams, name, on_wait, gate
        self.waits = 0

    def wait(self):
        if self.gate is not None:
            self.gate.wait(10)
        self.waits += 1
        self.streams.log.append((f"{self.name}.wait", self.streams.current))
        if self.on_wait:
            self.on_wait()

    def is_completed(self):
        return self.gate is None or self.gate.is_set()


def _comms(**kw):
    fields = dict(device=torch.device("cpu"), tp_group=None, pending_sends=[], groups={}, cupy={}, shm={}, rank=0)
    return types.SimpleNamespace(**{**fields, **kw})


@pytest.fixture
def staging(monkeypatch):
    """Set whether p2p is staged through host (what gloo does for CUDA tensors) for CPU tensors."""

    def set_(on: bool):
        monkeypatch.setattr(p2p, "stages_through_host", lambda device: on)

    return set_


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_receive_is_posted_on_the_p2p_stream_and_handed_to_compute(monkeypatch, staging):
    """NCCL-like (no staging): the receive need not wait for queued compute; its buffer, allocated on
    the p2p stream, is recorded on the compute stream that reads it."""
    staging(False)
    streams = FakeStreams()
    payload = torch.arange(24, dtype=torch.float32)
    works = []

    def irecv(buf, src, tag, group=None):
        streams.log.append(("irecv", streams.current))
        works.append(FakeWork(streams, "irecv", on_wait=lambda: buf.copy_(payload)))
        return works[-1]

    monkeypatch.setattr(p2p.dist, "irecv", irecv)
    pending = p2p.recv_boundary(_comms(), Route(0, 1, 0, 1), (2, 3, 4), torch.float32, 0, 5, 0, streams)
    assert streams.log == [("use", "p2p"), ("irecv", "p2p"), ("end", "p2p")]
    out = pending.wait(_comms())
    assert streams.log[3:] == [("irecv.wait", "compute"), ("hand_over", "compute")]
    assert _same_memory(streams.recorded[0][0], pending.buffer)
    assert torch.equal(out, payload.view(2, 3, 4))


def test_staged_send_copies_once_on_the_p2p_stream_before_gloo_reads(monkeypatch, staging):
    staging(True)
    streams = FakeStreams()
    sent = []

    def isend(tensor, dst, tag, group=None):
        streams.log.append(("isend", streams.current, dst))
        sent.append(tensor)
        return FakeWork(streams, "isend")

    monkeypatch.setattr(p2p.dist, "isend", isend)
    comms = _comms()
    x = torch.arange(10, dtype=torch.bfloat16).view(2, 5)
    p2p.send_boundary(comms, x, [Route(0, 1, 0, 2), Route(0, 2, 1, 2)], 0, 3, 0, streams)
    # One host copy for both pieces, made after the producing compute, complete before the sends.
    assert streams.log == [
        ("wait", "p2p", "compute"),
        ("use", "p2p"),
        ("end", "p2p"),
        ("synchronize", "p2p"),
        ("isend", "compute", 1),
        ("isend", "compute", 2),
    ]
    assert not any(_same_memory(t, x) for t in sent)
    assert [t.tolist() for t in sent] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert [t for _, t in comms.pending_sends] == sent  # kept alive until wait_sends


def test_staged_receive_polls_through_the_watcher_and_copies_on_the_p2p_stream(monkeypatch, staging):
    """The dynamic schedule's path: watch() + arrived() on a host buffer, wait() exactly once on the
    gloo work (in the watcher), then the copy to the device on the p2p stream, handed to compute."""
    staging(True)
    streams = FakeStreams()
    arrive = threading.Event()
    payload = torch.arange(12, dtype=torch.bfloat16)
    works = []

    def irecv(buf, src, tag, group=None):
        works.append(FakeWork(streams, "irecv", on_wait=lambda: buf.copy_(payload), gate=arrive))
        return works[-1]

    monkeypatch.setattr(p2p.dist, "irecv", irecv)
    pending = p2p.recv_boundary(_comms(), Route(0, 1, 0, 1), (3, 4), torch.bfloat16, 1, 2, 0, streams)
    assert pending.device == torch.device("cpu") and pending.buffer.device.type == "cpu"
    pending.watch()
    time.sleep(0.05)
    assert not pending.arrived()
    arrive.set()
    deadline = time.monotonic() + 10
    while not pending.arrived():
        assert time.monotonic() < deadline, "arrived() never turned true"
        time.sleep(0.001)
    out = pending.wait(_comms())
    assert works[0].waits == 1  # gloo's completion is consumed once, by the watcher
    assert streams.log[-4:] == [("use", "p2p"), ("end", "p2p"), ("wait", "compute", "p2p"), ("hand_over", "compute")]
    assert _same_memory(streams.recorded[-1][0], out)
    assert torch.equal(out, payload.view(3, 4))


def test_nccl_p2p_goes_out_as_batches_on_the_boundary_group(monkeypatch, staging):
    """NCCL path: every send and receive is a one-op batch_isend_irecv on the boundary's group (the group's
    own communicator, made under its network settings), never a lone isend/irecv (a lazy 2-rank one)."""
    staging(False)
    monkeypatch.setattr(p2p, "batched_p2p", lambda device: True)
    batches = []

    def batch_isend_irecv(ops):
        batches.append([(op.op, op.peer, op.group, op.tag, op.tensor.numel()) for op in ops])
        return [FakeWork(FakeStreams(), "batch")]

    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", batch_isend_irecv)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        comms = _comms()
        p2p.send_boundary(
            comms, torch.arange(10.0), [Route(0, 0, 0, 2), Route(0, 0, 1, 2)], 0, 3, 0, FakeStreams(), group
        )
        p2p.recv_boundary(comms, Route(0, 0, 1, 2), (2, 5), torch.float32, 1, 3, 0, FakeStreams(), group)
    finally:
        dist.destroy_process_group()
    real_isend, _real_irecv = dist.isend, dist.irecv
    assert [[(op is real_isend, peer, g is group, tag, n) for op, peer, g, tag, n in b] for b in batches] == [
        [(True, 0, True, p2p._tag(0, 3, 0, 0), 5)],
        [(True, 0, True, p2p._tag(0, 3, 0, 1), 5)],
        [(False, 0, True, p2p._tag(1, 3, 0, 1), 5)],
    ]


def test_grad_sync_packs_and_reduces_on_the_grads_stream(monkeypatch):
    streams = FakeStreams()
    calls = []

    def all_reduce(flat, group=None, async_op=False):
        streams.log.append(("all_reduce", streams.current, async_op))
        calls.append(flat)
        return FakeWork(streams, "all_reduce", on_wait=lambda: flat.mul_(2))

    monkeypatch.setattr(collectives.dist, "all_reduce", all_reduce)
    a, b = torch.ones(2, 3), torch.arange(4.0).view(2, 2)[:, 1:]  # the second is a strided view of a gradient
    comms = _comms(groups={GradSyncKey((0, 1)): object()})
    pending = collectives.start_all_reduce_flat(comms, [a, b], GradSyncKey((0, 1)), streams)
    assert streams.log == [
        ("wait", "grads", "compute"),
        ("use", "grads"),
        ("all_reduce", "grads", True),
        ("end", "grads"),
        ("hand_over", "grads"),
        ("hand_over", "grads"),
    ]
    assert [t for t, _ in streams.recorded] == [a, b]  # the inputs may be dropped by the caller: recorded
    summed = pending.wait()
    assert streams.log[6:] == [("all_reduce.wait", "compute"), ("wait", "compute", "grads"), ("hand_over", "compute")]
    assert streams.recorded[-1][0] is calls[0]
    assert torch.equal(summed[0], 2 * a) and torch.equal(summed[1], 2 * b)


def test_cpu_streams_are_no_ops():
    s = NO_STREAMS
    assert not s.active and s.compute is None and s.p2p is None and s.grads is None
    t = torch.ones(3)
    with s.use(s.p2p):
        s.wait(s.compute, s.p2p)
        s.hand_over(t, s.compute)
        s.synchronize(s.p2p)
