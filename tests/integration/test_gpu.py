"""The GPU path: CUDA streams for communication, host staging for gloo, and layout invariance on CUDA.

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

import json
import time
from pathlib import Path

import attrs
import pytest
import torch
import torch.distributed as dist
from helpers_precision import assert_bf16_close

from harness import GPU_SKIP, LAYOUTS, RTOL, assert_same_model, common_sections, free_port, launch, sections
from hetero_llm.comm import collectives, p2p
from hetero_llm.comm.groups import Comms
from hetero_llm.comm.streams import Streams
from hetero_llm.layout import Backend, ClusterSpec, Layout, NodeSpec, PipelineSpec, Schedule, StageSpec, dump
from hetero_llm.plan import Route

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_SKIP)


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
