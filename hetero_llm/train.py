"""One rank's training loop: schedule, gradient sync, global-norm clipping, AdamW, metrics, checkpoints."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import attrs
import numpy as np
import torch

from hetero_llm import comm, data
from hetero_llm.layout import Schedule, TrainSpec
from hetero_llm.model import init_shard
from hetero_llm.plan import Plan
from hetero_llm.runtime import Emulation, Microbatch, StageRoutes, StageRunner


def lr_at(train: TrainSpec, step: int) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``min_lr`` at the last step."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, train.steps - train.warmup_steps - 1)
    progress = min(1.0, (step - train.warmup_steps) / span)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1 + math.cos(math.pi * progress))


@attrs.frozen
class StepMetrics:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    seconds: float

    def json(self) -> str:
        return json.dumps(attrs.asdict(self))


@attrs.define
class RankState:
    """What one rank holds: its parameter shards (float32 leaves) and their layout coordinates."""

    params: dict[str, torch.Tensor]
    coords: dict[str, tuple[int | None, int, int, tuple[int, ...]]]  # name -> (shard dim, lo, hi, full shape)
    replicas: dict[str, int]  # name -> copies of this shard inside this rank's pipeline (TP-replicated)
    decay: dict[str, bool]


def init_state(plan: Plan, rank: int, device: torch.device) -> RankState:
    model, seed = plan.layout.model, plan.layout.train.seed
    tp = plan.stage_of(rank).tp
    params, coords, replicas, decay = {}, {}, {}, {}
    for info, lo, hi in plan.params_of(rank):
        params[info.name] = init_shard(info, model, seed, lo, hi).to(device).requires_grad_()
        coords[info.name] = (info.shard_dim, lo, hi, info.shape)
        replicas[info.name] = tp if info.shard_dim is None else 1
        decay[info.name] = info.decay
    return RankState(params, coords, replicas, decay)


def _block_view(state: RankState, name: str, dim: int, lo: int, hi: int) -> torch.Tensor:
    """The gradient of global block [lo, hi) along ``dim`` of ``name``, in local coordinates."""
    _, shard_lo, _, _ = state.coords[name]
    return state.params[name].grad.narrow(dim, lo - shard_lo, hi - lo)


def sync_grads(plan: Plan, rank: int, state: RankState, comms: comm.Comms) -> float:
    """Sum every gradient block among its holders; return this rank's share of the squared global norm.

    A TP-replicated shard is scaled by 1/replicas first, so the sum counts each pipeline once. The norm
    counts every block once: each holder contributes 1/len(group) of the (identical) summed block.
    """
    sq = sum(float(p.grad.double().pow(2).sum()) for p in state.params.values())
    for bucket in plan.buckets:
        if rank not in bucket.group:
            continue
        views = [_block_view(state, name, dim, lo, hi) for name, dim, lo, hi in bucket.entries]
        scaled = [v / state.replicas[name] if state.replicas[name] > 1 else v
                  for v, (name, *_rest) in zip(views, bucket.entries)]
        summed = comm.all_reduce_flat(comms, scaled, bucket.name)
        share = 1.0 / len(bucket.group)
        for view, new in zip(views, summed):
            sq -= float(view.double().pow(2).sum())
            view.copy_(new)
            sq += share * float(new.double().pow(2).sum())
    return sq


def _make_optimizer(state: RankState, train: TrainSpec) -> torch.optim.Optimizer:
    names = sorted(state.params)  # same order on every layout
    groups = [{"params": [state.params[n] for n in names if state.decay[n]], "weight_decay": train.weight_decay},
              {"params": [state.params[n] for n in names if not state.decay[n]], "weight_decay": 0.0}]
    fused = next(iter(state.params.values())).is_cuda
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=train.lr, betas=(train.beta1, train.beta2),
                             eps=train.eps, fused=fused or None)


def _microbatches(plan: Plan, rank: int, batch: np.ndarray) -> list[Microbatch]:
    pipe = plan.ranks[rank].pipeline
    offset, size = plan.batch_share(pipe)
    pieces = data.pipeline_share(batch, offset, size, plan.layout.pipelines[pipe].microbatches)
    return [Microbatch(torch.from_numpy(p[:, :-1]), torch.from_numpy(p[:, 1:])) for p in pieces]


@attrs.define
class Progress:
    """Console progress on the reporting rank: step, loss, tokens/s, ETA."""

    total: int
    out: object = sys.stdout
    started: float = attrs.field(factory=time.perf_counter)
    tokens: int = 0

    def update(self, m: StepMetrics) -> None:
        self.tokens += m.tokens
        elapsed = time.perf_counter() - self.started
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        eta = elapsed / (m.step + 1) * (self.total - m.step - 1)
        print(f"step {m.step + 1:>5}/{self.total} | loss {m.loss:.4f} | lr {m.lr:.2e} | grad_norm {m.grad_norm:.3f} "
              f"| {rate / 1e3:.1f}k tok/s | ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}", file=self.out, flush=True)


def train(plan: Plan, rank: int, comms: comm.Comms, *, metrics_path: str | None = None,
          checkpoint_dir: str | None = None, trace: list | None = None, quiet: bool = False) -> list[StepMetrics]:
    lay = plan.layout
    tr, model = lay.train, lay.model
    device = comms.device
    state = init_state(plan, rank, device)
    optimizer = _make_optimizer(state, tr)
    st = plan.stage_of(rank)
    runner = StageRunner(comms, state.params, st, model, comm.tp_ops(comms), StageRoutes.of(plan, rank), trace,
                         Emulation.from_env(rank))
    dynamic = tr.schedule is Schedule.DYNAMIC and not lay.pipelines[st.pipeline].schedule_file
    source = data.make_source(lay.data, lay.file)
    global_tokens = tr.global_batch * model.seq_len
    reporting = rank == plan.reporter()
    contributes_loss = st.last and plan.ranks[rank].tp_index == 0
    metrics_file = _open_metrics(metrics_path) if reporting and metrics_path else None
    progress = Progress(tr.steps) if reporting and not quiet else None
    history = []
    try:
        for step in range(tr.steps):
            t0 = time.perf_counter()
            lr = lr_at(tr, step)
            batch = data.global_batch(source, tr.seed, step, tr.global_batch, model.seq_len)
            mbs = _microbatches(plan, rank, batch)
            loss_sum = runner.run_dynamic(mbs, global_tokens) if dynamic else runner.run(plan.actions(rank), mbs, global_tokens)
            sq = sync_grads(plan, rank, state, comms)
            totals = torch.tensor([float(loss_sum) if contributes_loss else 0.0, sq], dtype=torch.float64, device=device)
            comm.all_reduce_world(totals)  # one collective for the logged loss and the squared norm
            loss, grad_norm = float(totals[0]) / global_tokens, math.sqrt(float(totals[1]))
            if tr.grad_clip > 0:
                coef = min(1.0, tr.grad_clip / (grad_norm + 1e-6))
                if coef < 1.0:
                    for p in state.params.values():
                        p.grad.mul_(coef)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            m = StepMetrics(step, loss, lr, grad_norm, global_tokens, time.perf_counter() - t0)
            history.append(m)
            if metrics_file is not None:
                _append_line(metrics_file, m.json())
            if progress is not None and (step % tr.log_every == 0 or step == tr.steps - 1):
                progress.update(m)
            elif progress is not None:
                progress.tokens += m.tokens
    finally:
        if metrics_file is not None:
            os.close(metrics_file)
    if checkpoint_dir:
        save_checkpoint(plan, rank, state, checkpoint_dir, tr.steps)
    return history


def _open_metrics(path: str) -> int:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


def _append_line(fd: int, line: str) -> None:
    # One write() per whole line: a crash never leaves a half-written record behind a complete one.
    os.write(fd, (line + "\n").encode())


# ------------------------------------------------------------------------------------------
# Checkpoints: per-rank shard files keyed by global names, written atomically; meta.json last.


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(plan: Plan, rank: int, state: RankState, directory: str, step: int) -> None:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    shards = {name: {"tensor": p.detach().cpu(), "coords": state.coords[name]} for name, p in state.params.items()}
    _atomic_save({"rank": rank, "step": step, "shards": shards}, out / f"rank{rank}.pt")
    comm.barrier()  # every shard is on disk before meta.json marks the checkpoint complete
    if rank == 0:
        meta = {"step": step, "world_size": plan.world_size, "layout": plan.layout.file}
        tmp = out / "meta.json.tmp"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, out / "meta.json")


def load_full_params(directory: str) -> dict[str, torch.Tensor]:
    """Assemble full (one-process) tensors from any layout's checkpoint."""
    d = Path(directory)
    meta = json.loads((d / "meta.json").read_text())
    full: dict[str, torch.Tensor] = {}
    for r in range(meta["world_size"]):
        for name, shard in torch.load(d / f"rank{r}.pt")["shards"].items():
            dim, lo, hi, shape = shard["coords"]
            if name not in full:
                full[name] = torch.full(tuple(shape), float("nan"))
            if dim is None:
                full[name].copy_(shard["tensor"])
            else:
                full[name].narrow(dim, lo, hi - lo).copy_(shard["tensor"])
    return full
