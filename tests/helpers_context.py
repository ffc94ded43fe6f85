"""Helpers shared by tests/integration/test_context.py and tests/unit/test_context_in_process.py; not a test module."""

from __future__ import annotations

import numpy as np
import torch
import torch.utils.checkpoint

from hetero_llm.model import cp_chunks
from hetero_llm.model.context import ContextShard, context_attention
from hetero_llm.model.document_mask import DocumentMask

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


def _spans(lengths: list[list[int]]) -> np.ndarray:
    spans = []
    for row, docs in enumerate(lengths):
        start = 0
        for n in docs:
            if n > 0:
                spans.append((row, start, n))
            start += abs(n)
    return np.array(spans, dtype=np.int64)


def _positions(spans: np.ndarray) -> np.ndarray:
    pos = np.zeros((B, SEQ), dtype=np.int64)
    for row, start, n in spans.tolist():
        pos[row, start : start + n] = np.arange(n)
    return pos


def _shard(ring, docs: list[list[int]] | None, device="cpu") -> tuple[ContextShard, torch.Tensor, DocumentMask | None]:
    """This rank's shard, its positions in the row, and the one-process document mask (None: plain causal)."""
    local = torch.as_tensor(cp_chunks.local_positions(SEQ, ring.size, ring.index), device=device)
    if docs is None:
        return ContextShard(ring, local, None, local.expand(B, -1)), local, None
    spans = _spans(docs)
    pos = _positions(spans)
    ids = torch.as_tensor(cp_chunks.document_ids(spans, B, SEQ), device=device)
    mask = DocumentMask.from_spans(spans, pos, device)
    shard = ContextShard(ring, local, ids[:, local], torch.as_tensor(pos, device=device)[:, local])
    return shard, local, mask


def _reference(q, k, v, mask: DocumentMask | None, dout, fn=None):
    """One-process attention over the whole rows (SDPA or the document mask), its output and q/k/v gradients."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    fn = fn or (lambda a: a)
    nh, nkv = q.shape[1], k.shape[1]
    if mask is not None:
        out = mask.attention(fn(q), k, v)
    else:
        kk, vv = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        out = torch.nn.functional.scaled_dot_product_attention(fn(q), kk, vv, is_causal=True)
    out.backward(dout.float())
    return out.detach(), q.grad, k.grad, v.grad


def _check_attention(ring, docs, nkv=4, dtype=torch.float32, recompute=False, seed=0, device="cpu") -> None:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 4, SEQ, 8, generator=gen).to(device, dtype)
    k, v = (torch.randn(B, nkv, SEQ, 8, generator=gen).to(device, dtype) for _ in range(2))
    dout = torch.randn(B, 4, SEQ, 8, generator=gen).to(device, dtype)
    shard, local, mask = _shard(ring, docs, device)
    fn = torch.sin if recompute else None  # something before attention, recomputed with it
    want = _reference(q, k, v, mask, dout, fn)
    ql, kl, vl = (t[:, :, local].detach().requires_grad_() for t in (q, k, v))
    if recompute:
        out = torch.utils.checkpoint.checkpoint(
            lambda a, b, c: context_attention(torch.sin(a), b, c, shard), ql, kl, vl, use_reentrant=False
        )
    else:
        out = context_attention(ql, kl, vl, shard)
    out.backward(dout[:, :, local])
    for got, ref in zip((out, ql.grad, kl.grad, vl.grad), want):
        assert got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref[:, :, local], **F32)
        else:
            want_local = ref[:, :, local]
            atol = BF16_STEPS * float(want_local.abs().max())
            torch.testing.assert_close(got.float(), want_local, rtol=BF16_STEPS, atol=atol)
