"""A rank's composition root: the one place that builds a rank from its ``RankPlan`` and the run's options, and
runs its steps.

``run`` is what every rank process runs (a rank the launcher forked, ``--rank R``, torchrun's and srun's ranks,
an elastic round's): its device, its communicators (``comm.groups``), its heartbeat and trace, then ``train``.
``train`` builds the rest in order (``build``: its state, from a save or the seed; the optimizer; the stage runner;
the data; the reporter and the saver; hot switching's ``Switcher``) and runs the steps (``train/loop.py``).
Benchmarks that make their own communicators call ``train``. It takes a ``RankPlan``, never the layout; what is not
yet a field of the RankPlan (the shared-memory rings, the bucket layouts' ``Switcher``) the launcher hands it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from hetero_llm.comm import collectives, groups, heartbeat
from hetero_llm.comm.groups import Comms
from hetero_llm.comm.shm import RankRings
from hetero_llm.comm.streams import Streams
from hetero_llm.errors import Diverged, LayoutError, RankFailure
from hetero_llm.plan.rank import RankPlan
from hetero_llm.predict import trace as tracing
from hetero_llm.runtime import context_rows, tensor_meter, zero1
from hetero_llm.runtime.emulation import Emulation
from hetero_llm.runtime.interpreter import StageRunner, Trace
from hetero_llm.runtime.state import make_optimizer
from hetero_llm.train import loop
from hetero_llm.train.batches import Batches
from hetero_llm.train.checkpointing import Saver, restore_moments, starting_state
from hetero_llm.train.metrics import Reporter, StepMetrics
from hetero_llm.train.options import RunOptions, report_failure


def run(rp: RankPlan, options: RunOptions, rings: RankRings, switcher: Callable | None = None) -> None:
    """Run the rank ``rp`` plans in this process, to its last step: its device checked, its communicators made
    (``rings``: its shared-memory boundaries), its heartbeat beating while it trains. A failure is reported where
    ``options.error_dir`` says (a launcher's rank) and raised; the rank serving the store gone is named."""
    # torch's flight recorder: ~1 MB of tracebacks that grows for 2000 steps (bench/memory/soak.py). Off unless asked.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")
    made = None  # the RankPlan, once the rendezvous and the groups are made
    try:
        device = torch.device(rp.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RankFailure(f"device {rp.device} requested but CUDA is not available on this host")
        agree = Path(options.resume).name if options.resume else ""  # ranks resuming from different saves disagree
        comms = groups.init(rp, device, rings, agree=agree)
        made = rp
        events = tracing.RankTraceWriter(options.trace, rp) if options.trace else None
        try:
            give_up = _give_up(rp.rank, options)
            with heartbeat.Heartbeat(rp, give_up):
                train(rp, comms, options, trace=events, switcher=switcher)
        finally:
            if events is not None:
                events.close()
            groups.shutdown()
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        gone = _store_gone(made, e)
        report_failure(options, rp.rank, gone or e)
        if gone is not None:
            raise gone from None
        raise


def train(
    rp: RankPlan,
    comms: Comms,
    options: RunOptions,
    *,
    trace: Trace | None = None,
    switcher: Callable | None = None,
    keep_history: bool = False,
) -> list[StepMetrics]:
    """Build the rank ``rp`` plans over ``comms`` (``build``) and train it to ``train.steps``. Returns every step's
    metrics with ``keep_history`` (benchmarks), else none."""
    rank = build(rp, comms, options, trace, switcher)
    try:
        return loop.run_steps(rank, keep_history)
    finally:
        rank.saver.finish_snapshots(raise_failure=False)  # no write left running behind a failure (raised: the first)
        rank.reporter.close()


def build(
    rp: RankPlan, comms: Comms, options: RunOptions, trace: Trace | None = None, switcher: Callable | None = None
) -> loop.Rank:
    """Everything the rank's steps use, in the order it is made: its state (cut from the save ``options.resume``
    names, else from ``model.init_from``, else the seed), its optimizer (ZeRO-1's slices where the plan shards it),
    its stage runner, its data, its hot-switching ``Switcher`` (``switcher`` makes it, for a layout with
    [[buckets]]), its reporter and its saver (``--checkpoint``, ``--checkpoint-every``, an elastic run's snapshots)."""
    tr, device = rp.train, comms.device
    console = rp.reports and not options.quiet
    state, restored = starting_state(rp, device, options.resume, progress=console)
    streams = Streams(device)
    optimizer = (
        zero1.ShardedAdamW(rp, state, (tr.beta1, tr.beta2), tr.eps, tr.weight_decay, comms, streams)
        if rp.sharded_optimizer
        else make_optimizer(state, tr)
    )
    restore_moments(optimizer, state, restored)
    runner = _runner(rp, comms, state, optimizer, trace, streams)
    batches = Batches(rp, runner.ring)
    if rp.hot_switching:  # every bucket of a step under its own layout (switching/switcher.py)
        if switcher is None:
            raise ValueError("a layout with [[buckets]] trains through switching.switcher.Switcher: pass switcher=")
        compute_of = lambda bucket_rp: loop.stage_compute(bucket_rp, device)  # noqa: E731
        made = switcher(comms, state.params, state.coords, runner, compute_of, trace, streams)
    else:
        made = None
    first = restored.step if restored else 0
    reporter = Reporter.open(
        rp.reports, options.quiet, tr.steps, first, tr.log_every, options.metrics_jsonl, options.tensorboard
    )
    if restored:
        reporter.say(f"resuming from {restored.path} (step {restored.step} of {tr.steps})")
    saver = Saver(
        rp, options.checkpoint, options.checkpoint_every, progress=console, last=restored.path if restored else None
    )
    saver.snapshot_root, saver.snapshot_every = options.snapshot
    saver.keep, saver.keep_snapshots, saver.resumed = options.keep_last, options.keep_snapshots, saver.last
    rank = loop.Rank(rp, comms, state, optimizer, runner, streams, batches, reporter, saver, first, made)
    rank.meter = _meter(rank)
    return rank


def _runner(rp: RankPlan, comms: Comms, state, optimizer, trace: Trace | None, streams: Streams) -> StageRunner:
    """The interpreter of the rank's action lists over its stage's parameters (emulated devices: their waits)."""
    emulation = Emulation.from_env(rp.rank)
    tp_waits = collectives.TpWaits() if emulation.active else None
    return StageRunner(
        comms,
        state.params,
        rp.stage,
        rp.model,
        collectives.tp_ops(comms, tp_waits),
        rp.routes,
        trace,
        emulation,
        loop.stage_compute(rp, comms.device),
        streams,
        split_backward=rp.split_backward,
        tp_waits=tp_waits,
        ring=context_rows.ring_of(rp, comms),
        # a switching step reduce-scatters after its last switch (finish_reduce), not inside
        # the home layout's backward: a later bucket may still add to the gradients
        optimizer_hooks=optimizer.hooks() if rp.sharded_optimizer and not rp.hot_switching else {},
    )


def _meter(rank: loop.Rank):
    """Benchmarks: the bytes of tensors this rank holds, by what holds them (runtime/tensor_meter.py), or None."""
    meter = tensor_meter.from_env()
    if meter is not None:
        meter.register("parameters", lambda: rank.state.params.values())
        meter.register("optimizer", lambda: tensor_meter.tensors_of(rank.optimizer))
        meter.register("put-off weight gradients", rank.runner.put_off_tensors)
        if rank.switcher is not None:
            meter.register("bucket copies", rank.switcher.copies)
    return meter


def _store_gone(rp: RankPlan | None, e: BaseException) -> RankFailure | None:
    """Why this rank failed when the rank serving the store died under it (its connections broke, in gloo, shared
    memory or the store, each in its own words): that rank, named. None before the rendezvous, or while it answers."""
    if rp is None or isinstance(e, (LayoutError, Diverged)) or not isinstance(e, Exception):
        return None
    from hetero_llm.comm.rendezvous import server_gone

    return server_gone(rp)


def _give_up(rank: int, options: RunOptions) -> Callable[[str, float], None]:
    """What the heartbeat thread does when this rank gives up on a stopped peer: report it and end the process, or,
    in an elastic worker (``options.on_lost_peer``), say so and open the round's next generation: the worker's
    liveness thread then cuts the connections the main thread is blocked on, and the survivors recover in place."""

    def report(cause: str) -> None:
        report_failure(options, rank, RankFailure(cause))
        if not options.error_dir:  # no launcher to print it
            sys.stderr.write(f"error: {cause}\n")

    def give_up(cause: str, linger_s: float) -> None:
        if options.on_lost_peer is None:
            heartbeat.exit_now(cause, linger_s, report)
            return
        sys.stderr.write(f"elastic: {cause}; the survivors recover in place\n")
        options.on_lost_peer(cause)

    return give_up
