"""Hot switching on GPUs: the switch exchange (``p2p.exchange``: one ``batch_isend_irecv`` per switch in the switch
group) and [[buckets]] on CUDA devices.

CPU-runnable: the exchange over gloo, three processes whose pairs differ (one exchanges both ways, one only sends,
one takes part in nothing in one direction), plain and with the host staging gloo needs for CUDA tensors forced.
``@pytest.mark.gpu`` (skipped without CUDA, or without the GPUs the case needs): the same exchange of CUDA tensors
over NCCL on 2 or 3 GPUs, bit for bit what gloo delivers; tests/data/buckets_two.toml on one GPU (two ranks,
gloo, staged through host memory) and on two GPUs over NCCL, each against the one-process CUDA run (1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness import GPU_SKIP, RTOL, assert_same_model, free_port, launch
from hetero_llm.comm import groups, p2p

DATA = Path(__file__).resolve().parents[1] / "data"
TWO = DATA / "buckets_two.toml"  # home TP 2; documents of 1-12 positions under DP 2

# (sender, receiver, elements): 0 <-> 1 both ways, 2 -> 0 only; nothing goes to 2
PAIRS = ((0, 1, 5), (1, 0, 7), (2, 0, 3))


def _pairs(world: int) -> list[tuple[int, int, int]]:
    return [p for p in PAIRS if max(p[:2]) < world]


def gpus(n: int):
    return pytest.mark.skipif(
        torch.cuda.device_count() < n, reason=f"{GPU_SKIP}, with {n} GPU{'s' if n > 1 else ''} at least"
    )


def _message(src: int, dst: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(src * 10 + dst))


def _exchange_worker(rank: int, world: int, port: int, out: str, backend: str, staged: bool) -> None:
    """Each rank's part of PAIRS over ``backend``'s switch group (and, on NCCL, again over a gloo group of CUDA
    tensors, staged through host memory); writes what it received, by sender."""
    if staged:
        p2p.stages_through_host = lambda device, group=None: True  # as gloo with CUDA tensors, on CPU tensors
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    made = {backend: dist.new_group(list(range(world)))}
    groups._connect(made[backend], device, backend)  # as switch_group: the communicator made before any batch
    if backend == "nccl":
        made["gloo"] = dist.new_group(list(range(world)), backend="gloo")
    got = {}
    for name, group in made.items():
        sends = {dst: _message(rank, dst, n).to(device) for src, dst, n in _pairs(world) if src == rank}
        receives = {src: torch.full((n,), float("nan"), device=device) for src, dst, n in _pairs(world) if dst == rank}
        p2p.exchange(sends, receives, group)
        got[name] = {str(src): buf.cpu().tolist() for src, buf in receives.items()}
    dist.barrier()
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(got))


def _run_exchange(tmp_path: Path, backend: str, staged: bool = False, world: int = 3) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(_exchange_worker, args=(world, free_port(), str(tmp_path), backend, staged), nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _expected(rank: int, world: int = 3) -> dict:
    return {str(src): _message(src, dst, n).tolist() for src, dst, n in _pairs(world) if dst == rank}


@pytest.mark.multiprocess
@pytest.mark.parametrize("staged", [False, True], ids=["plain", "staged through host"])
def test_the_switch_exchange_over_gloo_delivers_every_message(staged, tmp_path):
    got = _run_exchange(tmp_path, "gloo", staged)
    assert [g["gloo"] for g in got] == [_expected(r) for r in range(3)]
    assert got[2]["gloo"] == {} and set(got[0]["gloo"]) == {"1", "2"}


@pytest.mark.gpu
@pytest.mark.multiprocess
@gpus(2)
def test_the_switch_exchange_on_nccl_matches_gloo_bit_for_bit(tmp_path):
    """On 3 GPUs (where there are) rank 2 sends to 0 and receives nothing: a batch of a subset of the group."""
    world = min(torch.cuda.device_count(), 3)
    got = _run_exchange(tmp_path, "nccl", world=world)
    assert [g["nccl"] for g in got] == [g["gloo"] for g in got] == [_expected(r, world) for r in range(world)]


def _on_one_gpu(folder: Path) -> Path:
    """TWO with each of its two ranks on a node of its own, both on cuda:0, over gloo."""
    one_node = '[[cluster.nodes]]\nname = "node0"\ndevices = ["cpu", "cpu"]\n'
    text = TWO.read_text()
    assert one_node in text
    nodes = "".join(f'[[cluster.nodes]]\nname = "g{r}"\ndevices = ["cuda:0"]\n' for r in range(2))
    text = text.replace(one_node, 'backend = "gloo"\n' + nodes).replace('"node0:0"', '"g0:0"')
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "buckets_one_gpu.toml"
    path.write_text(text.replace('"node0:1"', '"g1:0"'))
    return path


@pytest.fixture(scope="module")
def cuda_one_process(tmp_path_factory):
    """TWO's model, data and steps in one process on cuda:0, without buckets."""
    folder = tmp_path_factory.mktemp("cuda_one_process")
    text = TWO.read_text().split("[cluster]")[0] + (
        '[cluster]\n[[cluster.nodes]]\nname = "node0"\ndevices = ["cuda:0"]\n[[pipelines]]\nbatch = 4\n'
        'microbatches = 2\n[[pipelines.stages]]\nlayers = 2\ndevices = ["node0:0"]\n'
    )
    path = folder / "one_process.toml"
    path.write_text(text)
    return launch(path, folder)


@pytest.mark.gpu
@pytest.mark.multiprocess
@gpus(1)
def test_buckets_on_one_gpu_over_gloo_train_the_one_process_model(cuda_one_process, tmp_path):
    assert_same_model(launch(_on_one_gpu(tmp_path / "layout"), tmp_path / "run"), cuda_one_process, RTOL)


@pytest.mark.gpu
@pytest.mark.multiprocess
@gpus(2)
def test_buckets_on_two_gpus_over_nccl_train_the_one_process_model(cuda_one_process, tmp_path):
    on_gpus = ("--set", 'cluster.nodes[0].devices=["cuda:0", "cuda:1"]', "--set", "cluster.backend=nccl")
    assert_same_model(launch(TWO, tmp_path, *on_gpus), cuda_one_process, RTOL)
