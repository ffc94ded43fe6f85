"""Context-parallel attention (model/context.py over comm/ring.py) against one-process attention.

Each CP rank holds chunks r and 2cp-1-r of every row (model/cp_chunks.py). Every rank builds the same full
inputs from one seed, computes the one-process reference (outputs and gradients of the whole row), and checks
that ``context_attention`` on its own positions gives the matching rows: outputs and the gradients of q, k
and v within 1e-5 (float32). Gloo on CPU, one spawn per CP size running every case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from helpers_context import _check_attention, _shard
from helpers_launch import spawn_warm

from harness import GPU_SKIP, free_port
from hetero_llm.comm import collectives
from hetero_llm.comm.ring import Ring
from hetero_llm.layout import Mlp, ModelSpec, Norm, Position
from hetero_llm.model import context, cp_chunks
from hetero_llm.model.forward import TP, Compute, StageShape, init_shard, make_block_fn, stage_forward, token_loss_sum
from hetero_llm.model.params import shard_range, stage_params

SEQ = 48  # divisible by 2*cp for cp 1, 2, 3, 4

B = 2

F32 = {"rtol": 1e-5, "atol": 1e-5}

# bf16 inputs: the block math, the softmax merge and the gradient sums run in float32 and only results are
# rounded; the backward reads the rounded output (as flash attention does), which moves the gradients by about a
# bf16 step of the largest. So: within 2 bf16 steps (2^-7) of the float32 attention of the same bf16 inputs,
# relative to each element and to the largest magnitude of the tensor.
BF16_STEPS = 2**-7

# Document lengths per row (-1: padding to the end). Boundaries fall inside chunks and documents span chunks for
# every cp here (chunks of 24, 12, 8, 6); row 1 ends in padding.
DOCS = [[5, 20, 3, 13, 7], [30, 1, 9, -8]]


def _worker(rank: int, cp: int, port: int) -> None:
    torch.set_num_threads(1)  # up to 4 ranks on a 2-core machine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    try:
        ring = Ring(None, tuple(range(cp)), rank)
        _check_attention(ring, None)
        _check_attention(ring, DOCS, nkv=2, seed=2)  # GQA
        _check_attention(ring, DOCS, nkv=1, recompute=True, seed=3)
        _check_skipped_blocks(ring)
        _check_overlap(ring)
        _check_overlap(ring, overlap=False)
        if cp == 2:  # the rest once: a few seconds of CPU each, many more on a loaded machine
            _check_attention(ring, DOCS, seed=1)
            _check_attention(ring, None, nkv=2, recompute=True, seed=4)
            _check_attention(ring, DOCS, nkv=2, dtype=torch.bfloat16, seed=5)
            for model in MODELS.values():
                _check_stage(ring, model, None)
                _check_stage(ring, model, DOCS)
        if cp == 3:
            _check_stage(ring, MODELS["llama"], DOCS)
        if cp == 4:  # the same world as TP 2 x CP 2: rings see the local heads
            _check_tp_stage()
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_context_attention_matches_one_process(cp):
    """Outputs and gradients; packed documents straddling chunks; GQA; recompute; bf16; whole stages (embed,
    blocks, head) with RoPE and learned positions; which blocks are computed. Failures raise in the ranks."""
    spawn_warm(_worker, (cp, free_port()), cp)


def _gpu_worker(rank: int, cp: int, port: int, backend: str) -> None:
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    try:
        ring = Ring(None, tuple(range(cp)), rank)
        _check_attention(ring, None, device=device)
        _check_attention(ring, DOCS, nkv=2, recompute=True, seed=1, device=device)
        _check_attention(ring, DOCS, nkv=2, dtype=torch.bfloat16, seed=2, device=device)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_SKIP)
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_context_attention_on_cuda(backend):
    """CUDA tensors round the ring: gloo stages them through host memory (several ranks may share a GPU), NCCL
    sends them from the device with batched isend/irecv (a GPU per rank)."""
    import torch.multiprocessing as mp

    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a GPU per rank: runs on a machine with 2 GPUs (see README 'GPU tests')")
    mp.spawn(_gpu_worker, args=(2, free_port(), backend), nprocs=2, join=True)


MODELS = {
    "gpt": ModelSpec(layers=2, hidden=32, heads=4, vocab=32, seq_len=SEQ),
    "llama": ModelSpec(
        layers=2, hidden=32, heads=4, kv_heads=2, vocab=32, seq_len=SEQ,
        norm=Norm.RMSNORM, position=Position.ROPE, mlp=Mlp.SWIGLU,
    ),
}  # fmt: skip


def _stage_grads(model, tokens, targets, shard, mask, local, tp=None, tp_size=1, tp_index=0, recompute=False):
    infos = stage_params(model, 0, model.layers, True, True)
    p = {i.name: init_shard(i, model, 7, *shard_range(i, tp_size, tp_index)).requires_grad_() for i in infos}
    tp_ops = tp or TP(lambda x: x, lambda x: x)
    compute = Compute(recompute=recompute)
    run = make_block_fn(model, tp_ops, compute)
    shape = StageShape(0, model.layers, True, True)
    if shard is None:
        logits = stage_forward(p, tokens, shape, model, tp_ops, compute, run, docs=mask)
        token_loss_sum(logits, targets).backward()
    else:
        logits = stage_forward(p, tokens[:, local], shape, model, tp_ops, compute, run, ctx=shard)
        token_loss_sum(logits, targets[:, local]).backward()
    return logits.detach(), {n: t.grad for n, t in p.items()}


def _check_stage(ring, model, docs, tp=None, tp_size=1, tp_index=0) -> None:
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, model.vocab, (B, SEQ), generator=gen)
    targets = torch.randint(0, model.vocab, (B, SEQ), generator=gen)
    shard, local, mask = _shard(ring, docs)
    ref_logits, ref = _stage_grads(model, tokens, targets, None, mask, local, tp, tp_size, tp_index)
    for recompute in (False, True):
        logits, grads = _stage_grads(model, tokens, targets, shard, None, local, tp, tp_size, tp_index, recompute)
        torch.testing.assert_close(logits, ref_logits[:, local], **F32)
        for name, g in grads.items():
            dist.all_reduce(g, group=ring.group)  # the CP ranks hold the same parameters: gradients sum
            torch.testing.assert_close(g, ref[name], **F32, msg=lambda m, name=name: f"{name}: {m}")


def _check_tp_stage() -> None:
    """World 4 as TP 2 x CP 2: TP groups {0, 1}, {2, 3}; CP rings {0, 2}, {1, 3}."""
    rank = dist.get_rank()
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_index, cp_index = rank % 2, rank // 2
    group = tp_groups[cp_index]
    tp = TP(lambda x: collectives._Enter.apply(x, group, None), lambda x: collectives._Exit.apply(x, group, None))
    ring = Ring(cp_groups[tp_index], (tp_index, tp_index + 2), cp_index)
    _check_stage(ring, MODELS["llama"], DOCS, tp, 2, tp_index)


def _check_skipped_blocks(ring) -> None:
    """Causal zigzag: each rank computes 2cp+1 of its 4cp (query chunk, key chunk) blocks, forward and backward;
    documents that never cross a chunk boundary: only the 2 diagonal blocks."""
    cp = ring.size
    calls: list[str] = []
    forward, backward = context._block_forward, context._block_backward

    def count_forward(*args, **kwargs):
        calls.append("F")
        return forward(*args, **kwargs)

    def count_backward(*args, **kwargs):
        calls.append("B")
        return backward(*args, **kwargs)

    context._block_forward, context._block_backward = count_forward, count_backward
    try:
        for docs, blocks in ((None, 2 * cp + 1), ([[SEQ // (2 * cp)] * (2 * cp)] * B, 2)):
            calls.clear()
            _check_attention(ring, docs)
            assert calls.count("F") == blocks and calls.count("B") == blocks, (docs, calls)
    finally:
        context._block_forward, context._block_backward = forward, backward


class _LoggedRing:
    """The real ring, logging each shift posted and waited for beside the blocks computed."""

    def __init__(self, ring, log: list[str], overlap: bool = True, pace=None):
        self.ring, self.log, self.size, self.index = ring, log, ring.size, ring.index
        self.overlap, self.pace = overlap, pace

    def source(self, step):
        return self.ring.source(step)

    def all_gather(self, tensor):
        return self.ring.all_gather(tensor)

    def shift(self, tensors, tag):
        name = "kv" if tag == context.KV_TAG else "dkv"
        self.log.append(f"post {name}")
        pending, log = self.ring.shift(tensors, tag), self.log

        class Logged:
            def wait(self):
                log.append(f"wait {name}")
                return pending.wait()

        return Logged()


def _check_overlap(ring, overlap: bool = True) -> None:
    """Overlap on: each step's K/V transfer posted before its blocks and waited for after them; off
    (``cp_overlap = false``): posted after the blocks and waited for before any other block, the same result.
    An emulated device's pacing sees each step's visible query/key pairs once a pass, adding up to the row's."""
    log: list[str] = []
    paced: list[tuple[int, int]] = []
    forward, backward = context._block_forward, context._block_backward

    def count_forward(*args, **kwargs):
        log.append("block")
        return forward(*args, **kwargs)

    def count_backward(*args, **kwargs):
        log.append("block")
        return backward(*args, **kwargs)

    def pace(t0: float, pairs: int, passes: int) -> None:
        paced.append((pairs, passes))

    context._block_forward, context._block_backward = count_forward, count_backward
    try:
        _check_attention(_LoggedRing(ring, log, overlap, pace), None, seed=6)
    finally:
        context._block_forward, context._block_backward = forward, backward
    kv = [e for e in log if e != "post dkv" and e != "wait dkv"]
    assert kv.count("post kv") == 2 * (ring.size - 1), log  # forward and backward: every step but the last
    for i, e in enumerate(kv):
        if e == "post kv" and overlap:  # the blocks of this step come between the post and the wait
            assert kv[i + 1] == "block" and kv[kv.index("wait kv", i) - 1] == "block", log
        if e == "post kv" and not overlap:  # no block while a transfer travels
            assert "block" not in kv[i : kv.index("wait kv", i)], log
    if not overlap:  # the gradients too: waited for before the next block
        for i, e in enumerate(log):
            if e == "post dkv" and "wait dkv" in log[i:]:
                assert "block" not in log[i : log.index("wait dkv", i)], log
    held = cp_chunks.local_positions(SEQ, ring.size, ring.index)
    row_pairs = B * int((held + 1).sum())  # causal: a query at position p sees p + 1 keys
    assert [n for _, n in paced] == [1] * ring.size + [2] * ring.size
    assert sum(p for p, n in paced if n == 1) == sum(p for p, n in paced if n == 2) == row_pairs
