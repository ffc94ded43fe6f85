"""One rank's steps: each runs the schedule, syncs gradients, clips to the global norm and steps the optimizer.

Everything here takes the rank's ``RankPlan`` (what compiling the layout resolved for it), never the layout, and the
``Rank`` that ``train/rank.py`` built from it. What a step reports goes through train/metrics.py, saving and resuming
through train/checkpointing.py; the rank's state and gradient sync live in runtime/."""

from __future__ import annotations

import math
import os
import time
from typing import Any

import attrs
import torch

from hetero_llm.comm import collectives
from hetero_llm.comm.groups import Comms
from hetero_llm.comm.streams import Streams
from hetero_llm.errors import Diverged, RankFailure
from hetero_llm.layout import Precision, TrainSpec
from hetero_llm.model.forward import Compute
from hetero_llm.plan.rank import RankPlan
from hetero_llm.runtime import tensor_meter
from hetero_llm.runtime.grad_sync import sync_grads
from hetero_llm.runtime.interpreter import StageRunner
from hetero_llm.runtime.state import RankState
from hetero_llm.train.batches import Batches
from hetero_llm.train.checkpointing import Saver
from hetero_llm.train.metrics import Reporter, StepMetrics


def lr_at(train: TrainSpec, step: int) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``min_lr`` at the last step."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, train.steps - train.warmup_steps - 1)
    progress = min(1.0, (step - train.warmup_steps) / span)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1 + math.cos(math.pi * progress))


def stage_compute(rp: RankPlan, device: torch.device) -> Compute:
    """How the rank's stage computes (``RankPlan.compute``: train.precision, its stage's recompute, else
    train.recompute, train.compile), checked against the device."""
    settings = rp.compute
    dtype = torch.bfloat16 if settings.precision is Precision.BF16 else torch.float32
    if dtype is torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RankFailure(
            f"train.precision = 'bf16' but {torch.cuda.get_device_name(device)} does not support "
            "bfloat16 (use precision = 'fp32' on this GPU)"
        )
    return Compute(dtype, recompute=settings.recompute, compile=settings.compile)


@attrs.define
class Rank:
    """One rank built from its plan (``train/rank.py``): everything its steps use."""

    rp: RankPlan
    comms: Comms
    state: RankState
    optimizer: Any  # AdamW, torch's, or ZeRO-1's ShardedAdamW (``sharded``)
    runner: StageRunner
    streams: Streams
    batches: Batches  # each step's microbatches and the held-out ones
    reporter: Reporter
    saver: Saver
    first: int  # the step it starts at (a resumed run: the save's)
    switcher: Any = None  # a layout with [[buckets]]: its switching.switcher.Switcher
    meter: Any = None  # benchmarks: the tensor meter (runtime/tensor_meter.py)

    @property
    def sharded(self) -> bool:
        return self.rp.sharded_optimizer


def run_steps(rank: Rank, keep_history: bool = False) -> list[StepMetrics]:
    """Train ``rank`` from its first step to ``train.steps``. Returns every step's metrics with ``keep_history``
    (benchmarks), else none: a long run must not grow by a record per step (bench/memory/soak.py)."""
    rp, saver, reporter = rank.rp, rank.saver, rank.reporter
    tr = rp.train
    history = []
    for step in range(rank.first, tr.steps):
        t0 = time.perf_counter()
        lr = lr_at(tr, step)
        loss_sum, global_tokens = _run_schedule(rank, step)
        tensor_meter.checkpoint()  # the step's gradients beside its activations
        loss, grad_norm = _loss_and_norm(rank, loss_sum, global_tokens)
        _check_finite(step, loss, grad_norm, saver.last)
        _update(rank.optimizer, rank.state, rank.sharded, lr, grad_norm, tr.grad_clip, wait=rank.switcher is not None)
        tensor_meter.checkpoint()  # the optimizer's state once it has stepped
        done = step + 1
        seconds = time.perf_counter() - t0  # the training step's time: evaluation is not part of it
        valid_loss = None
        if rank.batches.has_held_out and tr.eval_every and (done % tr.eval_every == 0 or done == tr.steps):
            valid_loss = held_out_loss(rank)
        m = StepMetrics(done, loss, lr, grad_norm, global_tokens, seconds, valid_loss)
        if keep_history:
            history.append(m)
        reporter.record(m)
        _save(rank, done)
    saver.finish_snapshots()  # the last snapshot whole before training returns
    if rank.sharded:
        rank.optimizer.wait_gather()  # the parameters are whole again when training returns
    if rank.meter is not None:
        rank.meter.write(os.environ[tensor_meter.ENV], rp.rank)
    return history


def _run_schedule(rank: Rank, step: int) -> tuple[torch.Tensor, int]:
    """Step ``step``'s forward and backward passes: this rank's share of the summed token loss, and the number
    of targets the step's mean loss divides by."""
    rp, runner = rank.rp, rank.runner
    if rank.switcher is not None:  # every bucket of a step under its own layout (switching/switcher.py)
        with tensor_meter.saving():
            return rank.switcher.step(step, rank.batches.source)
    mbs, global_tokens = rank.batches.step(step)
    with tensor_meter.saving():
        loss_sum = runner.run_dynamic(mbs, global_tokens) if rp.dynamic else runner.run(rp.actions, mbs, global_tokens)
    return loss_sum, global_tokens


def _loss_and_norm(rank: Rank, loss_sum: torch.Tensor, global_tokens: int) -> tuple[float, float]:
    """The step's mean loss and global gradient norm, summed over every rank in one collective."""
    sq = rank.optimizer.finish_reduce() if rank.sharded else sync_grads(rank.rp, rank.state, rank.comms, rank.streams)
    # held-out batches run under the home layout; a switching step returns only what this rank's loss counts for
    contributes_loss = rank.rp.counts_loss or rank.switcher is not None
    totals = torch.stack([loss_sum if contributes_loss else torch.zeros_like(loss_sum), sq])
    collectives.all_reduce_world(totals)  # one collective for the logged loss and the squared norm
    loss_total, sq_total = totals.tolist()  # the step's one host sync
    return loss_total / global_tokens, math.sqrt(sq_total)


def _check_finite(step: int, loss: float, grad_norm: float, last_save) -> None:
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # the same on every rank: all stop here
        raise Diverged(
            f"training diverged at step {step + 1} (counting from 1, as the console and "
            f"--metrics-jsonl do): "
            f"loss {loss}, gradient norm {grad_norm}; every rank stopped before its optimizer "
            f"step, {f'the last save is {last_save}' if last_save else 'nothing was saved'} "
            f"(lower train.lr, or raise train.warmup_steps)"
        )


def _save(rank: Rank, done: int) -> None:
    """The saves step ``done`` is due for: a save into --checkpoint DIR, or a snapshot in node memory."""
    saver = rank.saver
    if saver.due(done):
        folder = saver.save(rank.state, rank.optimizer, done)
        rank.reporter.say(f"saved {folder} (step {done} of {rank.rp.train.steps})")  # complete once returned
    elif saver.snapshot_due(done):
        saver.snapshot(rank.state, rank.optimizer, done)  # a CPU copy now, written while the next steps compute
    saver.check_snapshot()  # a failed background write fails the run, naming the rank


def _update(optimizer, state, sharded: bool, lr: float, grad_norm: float, grad_clip: float, wait: bool) -> None:
    """Clip to the global norm and step the optimizer (ZeRO-1: this rank's slices, then the all-gather starts;
    ``wait``: a switching step's next switch reads the home parameters whole, so wait for it now)."""
    coef = min(1.0, grad_clip / (grad_norm + 1e-6)) if grad_clip > 0 else 1.0
    if sharded:
        optimizer.step(lr, coef)  # clips and updates this rank's slices only
        optimizer.start_gather()  # waited for at the stage's next AG action (before its first forward)
        if wait:
            optimizer.wait_gather()
    else:
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in state.params.values()], coef)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def held_out_loss(rank: Rank) -> float:
    """The mean token loss over the held-out batches (data/held_out.py), every rank's share run forward only
    (packed documents: over their targets, padding excluded). They run under the home layout."""
    rp, runner = rank.rp, rank.runner
    total = torch.zeros((), dtype=torch.float64, device=runner.comms.device)
    targets = 0
    for mbs, tokens in rank.batches.held_out():
        loss_sum = runner.run_forward(rp.actions, mbs, tokens)
        targets += tokens
        if rp.counts_loss:
            total += loss_sum
    collectives.all_reduce_world(total)
    return float(total) / targets
