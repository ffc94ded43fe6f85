"""One rank's training loop: each step runs the schedule, syncs gradients, clips to the global norm and steps
the optimizer.

Everything here takes the rank's ``RankPlan`` (what compiling the layout resolved for it), never the layout.
What a step reports goes through train/metrics.py, saving and resuming through train/checkpointing.py; the
rank's state and gradient sync live in runtime/."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from hetero_llm.comm import collectives
from hetero_llm.comm.groups import Comms
from hetero_llm.comm.ring import Ring
from hetero_llm.comm.streams import Streams
from hetero_llm.data import batches, documents, held_out
from hetero_llm.errors import Diverged, RankFailure
from hetero_llm.layout import Packing, Precision, TrainSpec
from hetero_llm.model.document_mask import DocumentMask
from hetero_llm.model.forward import Compute
from hetero_llm.plan.rank import RankPlan
from hetero_llm.runtime import context_rows, tensor_meter, zero1
from hetero_llm.runtime.emulation import Emulation
from hetero_llm.runtime.grad_sync import sync_grads
from hetero_llm.runtime.interpreter import Microbatch, StageRunner
from hetero_llm.runtime.state import make_optimizer
from hetero_llm.train.checkpointing import Saver, restore_moments, starting_state
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


def _microbatches(rp: RankPlan, batch: np.ndarray, ring: Ring | None = None) -> list[Microbatch]:
    """The rank's microbatches (``ring``: a context-parallel rank's columns of them, ``context_rows``)."""
    share = rp.batch
    pieces = batches.pipeline_share(batch, share.offset, share.size, share.microbatches)
    if ring is not None:
        cut = [context_rows.context_columns(ring, rp.model.seq_len, p[:, :-1], p[:, 1:]) for p in pieces]
        return [Microbatch(inputs, targets, ctx=shard) for inputs, targets, shard in cut]
    return [Microbatch(torch.from_numpy(p[:, :-1]), torch.from_numpy(p[:, 1:])) for p in pieces]


def _packed_microbatches(rp: RankPlan, batch: documents.PackedRows, ring: Ring | None = None) -> list[Microbatch]:
    """The rank's microbatches of packed documents, each with its document mask (built on the host), or with
    a context-parallel rank's columns and their documents (``ring``)."""
    share = rp.batch
    pieces = batch.share(share.offset, share.size, share.microbatches)
    if ring is not None:
        seq = rp.model.seq_len
        cut = [context_rows.context_columns(ring, seq, p.inputs, p.targets, p.spans, p.positions) for p in pieces]
        return [Microbatch(inputs, targets, ctx=shard) for inputs, targets, shard in cut]
    return [
        Microbatch(
            torch.from_numpy(p.inputs), torch.from_numpy(p.targets), DocumentMask.from_spans(p.spans, p.positions)
        )
        for p in pieces
    ]


def train(
    rp: RankPlan,
    comms: Comms,
    *,
    metrics_path: str | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    resume: str | None = None,
    trace: list | None = None,
    quiet: bool = False,
    keep_history: bool = False,
    tensorboard: str | None = None,
    switcher: Callable | None = None,
    snapshot: tuple[str | None, int] = (None, 0),
) -> list[StepMetrics]:
    """Train the rank ``rp`` plans to ``train.steps``; save into ``checkpoint_dir`` every ``checkpoint_every`` steps
    (0: at the end only) and at the end; start from the save ``resume`` names (a step folder or a checkpoint root).
    ``snapshot``: (folder, every) also saves every ``every`` steps into that folder (an elastic run's snapshots in
    node memory), written in the background (checkpoint/snapshots.py). ``switcher``: for a layout with [[buckets]], what makes the rank's ``switcher.Switcher`` (the launcher binds
    the bucket layouts to it) from (comms, params, coords, runner, compute_of, trace, streams).

    Returns every step's metrics with ``keep_history`` (benchmarks), else none: a long run must not grow
    by a record per step (bench/soak.py)."""
    tr, model, rank = rp.train, rp.model, rp.rank
    device = comms.device
    console = rp.reports and not quiet
    state, restored = starting_state(rp, device, resume, progress=console)
    first = restored.step if restored else 0
    streams = Streams(device)
    sharded = rp.sharded_optimizer
    optimizer = (
        zero1.ShardedAdamW(rp, state, (tr.beta1, tr.beta2), tr.eps, tr.weight_decay, comms, streams)
        if sharded
        else make_optimizer(state, tr)
    )
    restore_moments(optimizer, state, restored)
    emulation = Emulation.from_env(rank)
    tp_waits = collectives.TpWaits() if emulation.active else None
    runner = StageRunner(
        comms,
        state.params,
        rp.stage,
        model,
        collectives.tp_ops(comms, tp_waits),
        rp.routes,
        trace,
        emulation,
        stage_compute(rp, device),
        streams,
        split_backward=rp.split_backward,
        tp_waits=tp_waits,
        ring=context_rows.ring_of(rp, comms),
        # a switching step reduce-scatters after its last switch (finish_reduce), not inside
        # the home layout's backward: a later bucket may still add to the gradients
        optimizer_hooks=optimizer.hooks() if sharded and not rp.hot_switching else {},
    )
    packed = rp.data.packing is Packing.DOCUMENTS
    if packed:
        source, valid = held_out.document_sources(rp.data, model.seq_len, rp.file)
    else:
        source, valid = held_out.train_and_held_out(rp.data, rp.file)
    global_tokens = tr.global_batch * model.seq_len
    contributes_loss = home_counts_loss = rp.counts_loss  # held-out batches run under the home layout
    if rp.hot_switching:  # every bucket of a step under its own layout (switching/switcher.py)
        if switcher is None:
            raise ValueError("a layout with [[buckets]] trains through switching.switcher.Switcher: pass switcher=")
        compute_of = lambda bucket_rp: stage_compute(bucket_rp, device)  # noqa: E731
        switcher = switcher(comms, state.params, state.coords, runner, compute_of, trace, streams)
        contributes_loss = True  # the switcher returns only what this rank's loss counts for
    else:
        switcher = None
    meter = tensor_meter.from_env()  # benchmarks: the bytes of tensors this rank holds (runtime/tensor_meter.py)
    if meter is not None:
        meter.register("parameters", lambda: state.params.values())
        meter.register("optimizer", lambda: tensor_meter.tensors_of(optimizer))
        meter.register("put-off weight gradients", runner.put_off_tensors)
        if switcher is not None:
            meter.register("bucket copies", switcher.copies)
    reporter = Reporter.open(rp.reports, quiet, tr.steps, first, tr.log_every, metrics_path, tensorboard)
    if restored:
        reporter.say(f"resuming from {restored.path} (step {restored.step} of {tr.steps})")
    saver = Saver(rp, checkpoint_dir, checkpoint_every, progress=console, last=restored.path if restored else None)
    saver.snapshot_root, saver.snapshot_every = snapshot
    history = []
    try:
        for step in range(first, tr.steps):
            t0 = time.perf_counter()
            lr = lr_at(tr, step)
            if switcher is not None:
                with tensor_meter.saving():
                    loss_sum, global_tokens = switcher.step(step, source)
            else:
                if packed:  # the loss averages over the documents' targets, not over the rows' padding
                    rows = documents.fill_rows(source, tr.seed, step, tr.global_batch, model.seq_len)
                    global_tokens, mbs = rows.num_targets, _packed_microbatches(rp, rows, runner.ring)
                else:
                    batch = batches.global_batch(source, tr.seed, step, tr.global_batch, model.seq_len)
                    mbs = _microbatches(rp, batch, runner.ring)
                with tensor_meter.saving():
                    loss_sum = (
                        runner.run_dynamic(mbs, global_tokens)
                        if rp.dynamic
                        else runner.run(rp.actions, mbs, global_tokens)
                    )
            tensor_meter.checkpoint()  # the step's gradients beside its activations
            sq = optimizer.finish_reduce() if sharded else sync_grads(rp, state, comms, streams)
            totals = torch.stack([loss_sum if contributes_loss else torch.zeros_like(loss_sum), sq])
            collectives.all_reduce_world(totals)  # one collective for the logged loss and the squared norm
            loss_total, sq_total = totals.tolist()  # the step's one host sync
            loss, grad_norm = loss_total / global_tokens, math.sqrt(sq_total)
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # the same on every rank: all stop here
                raise Diverged(
                    f"training diverged at step {step + 1} (counting from 1, as the console and "
                    f"--metrics-jsonl do): "
                    f"loss {loss}, gradient norm {grad_norm}; every rank stopped before its optimizer "
                    f"step, {f'the last save is {saver.last}' if saver.last else 'nothing was saved'} "
                    f"(lower train.lr, or raise train.warmup_steps)"
                )
            _update(optimizer, state, sharded, lr, grad_norm, tr.grad_clip, wait=switcher is not None)
            tensor_meter.checkpoint()  # the optimizer's state once it has stepped
            done = step + 1
            seconds = time.perf_counter() - t0  # the training step's time: evaluation is not part of it
            valid_loss = None
            if valid is not None and tr.eval_every and (done % tr.eval_every == 0 or done == tr.steps):
                valid_loss = held_out_loss(rp, runner, valid, home_counts_loss)
            m = StepMetrics(done, loss, lr, grad_norm, global_tokens, seconds, valid_loss)
            if keep_history:
                history.append(m)
            reporter.record(m)
            if saver.due(done):
                folder = saver.save(state, optimizer, done)
                reporter.say(f"saved {folder} (step {done} of {tr.steps})")  # complete (meta.json) once returned
            elif saver.snapshot_due(done):
                saver.snapshot(state, optimizer, done)  # a CPU copy now, written while the next steps compute
            saver.check_snapshot()  # a failed background write fails the run, naming the rank
        saver.finish_snapshots()  # the last snapshot whole before training returns
        if sharded:
            optimizer.wait_gather()  # the parameters are whole again when training returns
        if meter is not None:
            meter.write(os.environ[tensor_meter.ENV], rank)
    finally:
        saver.finish_snapshots(raise_failure=False)  # no write left running behind a failure (raised: the first)
        reporter.close()
    return history


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


def held_out_loss(rp: RankPlan, runner: StageRunner, valid, contributes_loss: bool) -> float:
    """The mean token loss over the held-out batches (data/held_out.py), every rank's share run forward only
    (packed documents: over their targets, padding excluded)."""
    tr, model = rp.train, rp.model
    total = torch.zeros((), dtype=torch.float64, device=runner.comms.device)
    targets = 0
    for index in range(tr.eval_batches):
        if rp.data.packing is Packing.DOCUMENTS:
            rows = held_out.held_out_rows(valid, tr.seed, index, tr.global_batch, model.seq_len)
            tokens, mbs = rows.num_targets, _packed_microbatches(rp, rows, runner.ring)
        else:
            tokens = tr.global_batch * model.seq_len
            mbs = _microbatches(rp, held_out.batch(valid, tr.seed, index, tr.global_batch, model.seq_len), runner.ring)
        loss_sum = runner.run_forward(rp.actions, mbs, tokens)
        targets += tokens
        if contributes_loss:
            total += loss_sum
    collectives.all_reduce_world(total)
    return float(total) / targets
