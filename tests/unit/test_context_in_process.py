"""The tests of tests/integration/test_context.py that run in this process (the unit tier).

Context-parallel attention (model/context.py over comm/ring.py) against one-process attention.

Each CP rank holds chunks r and 2cp-1-r of every row (model/cp_chunks.py). Every rank builds the same full
inputs from one seed, computes the one-process reference (outputs and gradients of the whole row), and checks
that ``context_attention`` on its own positions gives the matching rows: outputs and the gradients of q, k
and v within 1e-5 (float32). Gloo on CPU, one spawn per CP size running every case.
"""

from __future__ import annotations

import pytest
from helpers_context import _check_attention

from hetero_llm.comm.ring import SOLO

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


@pytest.mark.parametrize("docs", [None, DOCS], ids=["causal", "documents"])
@pytest.mark.parametrize("nkv", [4, 2])
def test_one_rank_ring_is_plain_attention(docs, nkv):
    _check_attention(SOLO, docs, nkv=nkv)
