"""The GPU benchmark's single-stage runs (``python -m bench.gpu.gpu_bench``), in this process on one device: ours
(``hetero_llm.train.rank.train`` on a one-rank layout) and the plain PyTorch baseline, each timed per step.
"""

from __future__ import annotations

import gc
import math
import os
import time
from pathlib import Path

import attrs
import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.common import benchlib
from bench.gpu.gpu_bench_cases import Case, Size, layout_toml
from hetero_llm import layout as layout_mod
from hetero_llm.comm import groups, shm
from hetero_llm.comm.groups import Comms
from hetero_llm.data import batches, sources
from hetero_llm.plan import compile_plan
from hetero_llm.train.options import RunOptions
from hetero_llm.train.rank import train


@attrs.define
class World:
    """The one-rank process group the in-process runs of ours share (it can be created once)."""

    device: torch.device
    comms: Comms | None = None

    def get(self, plan) -> Comms:
        if self.comms is None:
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(benchlib.free_port())
            self.comms = groups.init(plan.rank_plan(0), self.device, shm.rank_rings(plan, 0))
        return self.comms


@attrs.frozen
class Run:
    impl: str  # "ours" | "plain"
    mode: str  # "eager" | "compiled"
    seconds: list[float]  # per step
    final_loss: float
    peak_gb: float


def _reset(device: torch.device) -> None:
    torch._dynamo.reset()  # a fresh compile cache per run (and no recompile limit across model sizes)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def run_ours(case: Case, mode: str, steps: int, device: torch.device, corpus: Path, world: World) -> Run:
    _reset(device)
    text = layout_toml(
        case,
        devices=[str(device)],
        steps=steps,
        corpus=corpus,
        compile_mode="blocks" if mode == "compiled" else "none",
        backend="nccl" if device.type == "cuda" else "gloo",
    )
    plan = compile_plan(layout_mod.loads(text, file="<gpu_bench>"))
    history = train(plan.rank_plan(0), world.get(plan), RunOptions(quiet=True), keep_history=True)
    return Run("ours", mode, [m.seconds for m in history], history[-1].loss, _peak_gb(device))


# ------------------------------------------------------------------------------------------
# The plain PyTorch baseline: same architecture and math, written the usual way.


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden, bias=False)
        self.fc_proj = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, size: Size, seq: int):
        super().__init__()
        self.tok = nn.Embedding(size.vocab, size.hidden)
        self.pos = nn.Embedding(seq, size.hidden)
        self.blocks = nn.ModuleList(Block(size.hidden, size.heads) for _ in range(size.layers))
        self.ln_f = nn.LayerNorm(size.hidden)
        self.head = nn.Linear(size.hidden, size.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * size.layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def run_plain(case: Case, mode: str, steps: int, device: torch.device, corpus: Path) -> Run:
    _reset(device)
    source = sources.make_source(layout_mod.DataSpec(kind=layout_mod.DataKind.TEXT, path=str(corpus)), "<gpu_bench>")
    model = PlainGPT(case.size, case.seq).to(device)
    decay = [p for p in model.parameters() if p.dim() == 2 and p is not model.tok.weight and p is not model.pos.weight]
    other = [p for p in model.parameters() if all(p is not d for d in decay)]
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=cuda or None,
    )
    forward = torch.compile(model) if mode == "compiled" else model
    seconds, loss_value = [], float("nan")
    for step in range(steps):
        t0 = time.perf_counter()
        batch = torch.from_numpy(batches.global_batch(source, 0, step, case.batch, case.seq))
        if cuda:
            batch = batch.pin_memory().to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()  # one host sync per step, as ours (for the logged loss)
        seconds.append(time.perf_counter() - t0)
    return Run("plain", mode, seconds, loss_value, _peak_gb(device))
