"""The GPU path: CUDA streams for communication, host staging for gloo, and layout invariance on CUDA.

Two parts:

1. CPU-runnable checks of the GPU code paths. The stream logic is checked against a fake
   ``streams.Streams`` that logs every stream hand-over (which stream is current when a receive is
   posted, who waits for whom, which tensor is recorded on which stream); host staging (what gloo
   needs for CUDA tensors) is forced on CPU tensors, both with fake p2p calls and over real gloo.
2. ``@pytest.mark.gpu`` tests, skipped without CUDA: the reference model on CUDA against CPU, and
   layouts of several ranks on the one GPU (backend gloo, p2p staged through host memory) against
   the one-process CUDA run, in float32 (1e-5) and bf16 (the tolerance of tests/test_precision.py).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import types
from pathlib import Path

import attrs
import pytest
import torch
import torch.distributed as dist
from helpers_precision import assert_bf16_close

from harness import GPU_SKIP, LAYOUTS, RTOL, assert_same_model, common_sections, free_port, launch, sections
from hetero_llm.comm import collectives, p2p
from hetero_llm.comm.groups import Comms
from hetero_llm.comm.streams import NO_STREAMS, Streams
from hetero_llm.layout import Backend, ClusterSpec, Layout, NodeSpec, PipelineSpec, Schedule, StageSpec, dump
from hetero_llm.plan import Route
from hetero_llm.plan.rank import GradSyncKey

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_SKIP)


# ------------------------------------------------------------------------------------------
# 1. Stream hand-overs, against a fake Streams


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


# ------------------------------------------------------------------------------------------
# 1b. Forced host staging over real gloo (two processes), including the watcher thread


def _staging_worker(rank: int, port: int, results: str) -> None:
    p2p.stages_through_host = lambda device: True  # as gloo with CUDA tensors, here on CPU tensors
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comms = Comms(rank, torch.device("cpu"), {}, None, (rank,))
    shape = (2, 3, 5)
    x = torch.arange(30, dtype=torch.bfloat16).view(shape)
    out = {}
    if rank == 0:
        p2p.send_boundary(comms, x, [Route(0, 1, 0, 1)], 0, 0, 0)
        back = p2p.recv_boundary(comms, Route(1, 0, 0, 1), shape, torch.bfloat16, 1, 0, 0)
        out["grad"] = back.wait(comms).float().tolist()
        p2p.wait_sends(comms)
    else:
        fwd = p2p.recv_boundary(comms, Route(0, 1, 0, 1), shape, torch.bfloat16, 0, 0, 0)
        fwd.watch()  # the dynamic schedule's polling
        deadline = time.monotonic() + 30
        while not fwd.arrived():
            assert time.monotonic() < deadline
            time.sleep(0.001)
        got = fwd.wait(comms)
        out["activation"] = got.float().tolist()
        p2p.send_boundary(comms, -got, [Route(1, 0, 0, 1)], 1, 0, 0)
        p2p.wait_sends(comms)
    dist.barrier()
    dist.destroy_process_group()
    Path(results, f"rank{rank}.json").write_text(json.dumps(out))


@pytest.mark.multiprocess
def test_host_staging_over_real_gloo(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_staging_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    want = torch.arange(30, dtype=torch.float32).view(2, 3, 5)
    assert json.loads((tmp_path / "rank1.json").read_text())["activation"] == want.tolist()
    assert json.loads((tmp_path / "rank0.json").read_text())["grad"] == (-want).tolist()


# ------------------------------------------------------------------------------------------
# 2. On CUDA (GPU machines): layout invariance, several ranks on one GPU


REFERENCE = LAYOUTS / "reference" / "reference.toml"
COMMON = common_sections(REFERENCE)  # 6 layers, hidden 32, 4 heads, global batch 12
ON_CUDA = ("--set", 'cluster.nodes[0].devices=["cuda:0"]')


def one_gpu_layout(path: Path, stages: list[tuple[int, int]], microbatches: int, schedule: str = "1f1b") -> Path:
    """One pipeline over ``stages`` [(layers, tp)], every rank on cuda:0 (one node per rank), gloo."""
    model, train, data = sections(COMMON, path)
    ranks = sum(tp for _, tp in stages)
    cluster = ClusterSpec(
        nodes=tuple(NodeSpec(name=f"g{r}", devices=("cuda:0",)) for r in range(ranks)), backend=Backend.GLOO
    )
    specs, r = [], 0
    for layers, tp in stages:
        specs.append(StageSpec(layers=layers, devices=tuple(f"g{r + i}:0" for i in range(tp))))
        r += tp
    dump(
        Layout(
            file=str(path),
            model=model,
            train=attrs.evolve(train, schedule=Schedule(schedule)),
            data=data,
            cluster=cluster,
            pipelines=(PipelineSpec(batch=12, microbatches=microbatches, stages=tuple(specs)),),
        ),
        path,
    )
    return path


ONE_GPU_CASES = [
    ("2 stages, 1f1b", [(4, 1), (2, 1)], 4, "1f1b"),
    ("1 stage, TP 2", [(6, 2)], 3, "1f1b"),
    ("3 stages tp [1, 2, 1], dynamic", [(2, 1), (3, 2), (1, 1)], 4, "dynamic"),
]


@pytest.fixture(scope="module")
def cuda_reference(tmp_path_factory):
    return launch(REFERENCE, tmp_path_factory.mktemp("cuda_reference"), *ON_CUDA)


@pytest.mark.gpu
@pytest.mark.multiprocess
@needs_cuda
def test_cuda_reference_matches_cpu_reference(cuda_reference, tmp_path):
    """Float32 on CUDA trains the CPU's model (cuBLAS and MKL round differently: within 1e-5)."""
    assert_same_model(cuda_reference, launch(REFERENCE, tmp_path), RTOL)


@pytest.mark.gpu
@pytest.mark.multiprocess
@needs_cuda
@pytest.mark.parametrize("name,stages,microbatches,schedule", ONE_GPU_CASES, ids=[c[0] for c in ONE_GPU_CASES])
def test_one_gpu_layout_float32(name, stages, microbatches, schedule, cuda_reference, tmp_path):
    path = one_gpu_layout(tmp_path / "layout.toml", stages, microbatches, schedule)
    assert_same_model(launch(path, tmp_path), cuda_reference, RTOL)


@pytest.mark.gpu
@pytest.mark.multiprocess
@needs_cuda
@pytest.mark.parametrize(
    "name,stages,microbatches,schedule",
    [("one process", [(6, 1)], 3, "1f1b")] + ONE_GPU_CASES,
    ids=["one process"] + [c[0] for c in ONE_GPU_CASES],
)
def test_one_gpu_layout_bf16(name, stages, microbatches, schedule, cuda_reference, tmp_path):
    path = one_gpu_layout(tmp_path / "layout.toml", stages, microbatches, schedule)
    assert_bf16_close(launch(path, tmp_path, "--set", "train.precision=bf16"), cuda_reference)


@pytest.mark.gpu
@pytest.mark.multiprocess
@needs_cuda
def test_compiled_and_recomputed_blocks_on_cuda(cuda_reference, tmp_path):
    """Inductor kernels fuse and reorder float32 arithmetic: the same model within 1e-4 (not 1e-5)."""
    path = one_gpu_layout(tmp_path / "layout.toml", [(4, 1), (2, 1)], 4)
    run = launch(path, tmp_path, "--set", "train.compile=blocks", "--set", "train.recompute=full", timeout=900)
    assert_same_model(run, cuda_reference, 1e-4)


@pytest.mark.gpu
@needs_cuda
def test_grad_sync_on_the_grads_stream_is_ordered_after_compute(tmp_path):
    """Real CUDA streams: the gradients are still being written on the compute stream (a long matmul
    queued before them) when the all-reduce starts on the grads stream; the sums must see the final
    values, and the compute stream must see the sums."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        device = torch.device("cuda", torch.cuda.current_device())
        streams = Streams(device)
        comms = Comms(0, device, {"g": dist.new_group([0])}, None, (0,))
        big = torch.randn(4096, 4096, device=device)
        grads = [torch.zeros(1000, device=device), torch.zeros(10, 10, device=device)]
        for _ in range(20):
            big = big @ big / 64  # keeps the compute stream busy
        grads[0].fill_(1)  # queued behind the matmuls on the compute stream
        grads[1].fill_(3)
        summed = collectives.start_all_reduce_flat(comms, grads, "g", streams).wait()
        total = summed[0].sum() + summed[1].sum()  # on the compute stream, after wait()
        assert float(total) == 1000 + 300
    finally:
        dist.destroy_process_group()
