"""One interpreter loop that executes any schedule's action list on one rank, plus the dynamic mode.

Static schedules (GPipe, 1F1B, interleaved, zero-bubble, files): sends are non-blocking and completed
at the end of the step; a receive is posted at its RECV action and waited for by the compute action
that needs it; compute actions run in list order. The validator in ``schedule`` simulates exactly
this. A stage whose list splits backwards (``I`` then ``W``) computes with a ``WeightGradStore``.

Dynamic schedule (MegatronDPP): every receive a rank will need is posted ahead (within its memory
window); the rank then repeatedly runs the highest-priority action whose input has arrived, polling
without blocking: a backward before a forward, lower microbatches first. Forwards are capped at the
1F1B in-flight bound (stages - stage), so memory equals 1F1B's. Ranks of a TP group must run the
same actions in the same order (their collectives pair up), so TP rank 0 decides and broadcasts; with
context parallelism the stage's TP x CP ranks do: CP rank 0's TP rank 0 decides, its TP group first, then
each CP ring passes the choice on (``context_rows.cp_agree``).
Deadlock-free: the last stage can always run a backward right after its forward, so some rank can
always move.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Protocol

import attrs
import torch

from hetero_llm.comm import collectives, p2p
from hetero_llm.comm.groups import Comms
from hetero_llm.comm.ring import Ring
from hetero_llm.comm.streams import NO_STREAMS, Streams
from hetero_llm.layout import ModelSpec
from hetero_llm.model.context import ContextShard
from hetero_llm.model.document_mask import DocumentMask
from hetero_llm.model.forward import (
    FP32,
    PLAIN_LINEAR,
    TP,
    BlockFn,
    Compute,
    Linear,
    StageShape,
    make_block_fn,
    stage_forward,
    token_loss_sum,
)
from hetero_llm.plan.rank import StagePlan, StageRoutes
from hetero_llm.predict.device import action_seconds
from hetero_llm.runtime import context_rows, tensor_meter
from hetero_llm.runtime.emulation import Emulation
from hetero_llm.runtime.wgrad import WeightGradStore
from hetero_llm.schedule import BACKWARD_KINDS, COMPUTE_KINDS, OPTIMIZER_KINDS, Action, Direction, Kind, peer


class Trace(Protocol):
    """Where a traced rank's ``(action string, start s, end s)`` records go: a list, or the launcher's
    ``predict.trace.RankTraceWriter``."""

    def append(self, record: tuple[str, float, float], /) -> None: ...


@attrs.define
class Microbatch:
    inputs: torch.Tensor  # (b, T) token ids
    targets: torch.Tensor  # (b, T)
    docs: DocumentMask | None = None  # the rows are packed documents (data.packing = 'documents')
    ctx: ContextShard | None = None  # a context-parallel stage: inputs/targets are this rank's columns of the rows


@attrs.define
class StepState:
    """What one step holds between actions; ``key`` is ``(microbatch, chunk)``."""

    mbs: list[Microbatch]
    tokens: int  # tokens of the global batch: the loss divides by them
    loss: torch.Tensor  # this rank's summed token loss, float64 (stays 0 off the last stage)
    dtype: torch.dtype  # boundary tensors travel in the compute dtype
    inputs: dict = attrs.field(factory=dict)  # key -> the chunk's input (a leaf that takes the gradient)
    outputs: dict = attrs.field(factory=dict)  # key -> the chunk's output (the scaled loss on the last), until backward
    recvs: dict = attrs.field(factory=dict)  # (Direction, key) -> a posted receive, until the compute that needs it
    grads_out: dict = attrs.field(factory=dict)  # key -> the input gradient SEND_B sends back


@attrs.define
class StageRunner:
    """Executes one rank's actions for one step; accumulates gradients into ``params``."""

    comms: Comms
    params: dict[str, torch.Tensor]
    stage: StagePlan
    model: ModelSpec
    tp: TP
    routes: StageRoutes
    trace: Trace | None = None  # (action string, start s, end s) per action, when tracing
    emulation: Emulation = Emulation()
    compute: Compute = FP32  # precision, recomputation, compilation of this stage
    streams: Streams = NO_STREAMS  # side CUDA streams for p2p (none on CPU)
    split_backward: bool = False  # the schedule has I/W actions: linear layers can put off weight gradients
    optimizer_hooks: dict = attrs.field(factory=dict)  # Kind.RS / Kind.AG -> what ZeRO-1 does there (zero1.py)
    tp_waits: collectives.TpWaits | None = None  # what ``tp``'s all-reduces add their seconds to (when emulating)
    ring: Ring | None = None  # the stage's CP group this rank is in (cp > 1): its ranks run the same actions
    _rng: random.Random = attrs.field(init=False)
    _state: StepState | None = attrs.field(init=False, default=None)  # of the step running
    _block_fn: BlockFn = attrs.field(init=False)
    _weight_grads: WeightGradStore | None = attrs.field(init=False, default=None)
    _linear: Linear = attrs.field(init=False, default=PLAIN_LINEAR)

    def __attrs_post_init__(self):
        self._rng = random.Random(self.emulation.seed)
        if self.split_backward:
            self._weight_grads = WeightGradStore()
            self._linear = self._weight_grads.linear
        self._block_fn = make_block_fn(self.model, self.tp, self.compute, self._linear)  # built once: compiled once
        if self.ring is not None and self.emulation.active:  # attention blocks paced, ring waits counted
            self.ring = context_rows.emulated_ring(self.ring, self.model, self.stage.tp, self.emulation.device)

    @property
    def _step(self) -> StepState:
        """The step running (``_begin`` starts it)."""
        assert self._state is not None, "no step is running: _begin starts one"
        return self._state

    @property
    def chunks(self) -> int:
        return len(self.stage.chunk_ranges)

    def put_off_tensors(self) -> list[torch.Tensor]:
        """The tensors a split backward holds outside autograd until its ``W`` (``WeightGradStore.held``), for the
        tensor meter."""
        return self._weight_grads.held() if self._weight_grads is not None else []

    # -- one action ---------------------------------------------------------------------------

    def _begin(self, microbatches: list[Microbatch], global_tokens: int) -> None:
        device = self.comms.device
        if device.type == "cuda":  # one asynchronous copy each, now: a pageable copy per action would stall the host
            microbatches = [
                Microbatch(
                    mb.inputs.pin_memory().to(device, non_blocking=True),
                    mb.targets.pin_memory().to(device, non_blocking=True),
                    mb.docs.to(device) if mb.docs is not None else None,
                    context_rows.shard_to(mb.ctx, device) if mb.ctx is not None else None,
                )
                for mb in microbatches
            ]
        self._state = StepState(
            microbatches, global_tokens, torch.zeros((), dtype=torch.float64, device=device), self.compute.dtype
        )

    def _shape(self, m: int) -> tuple[int, ...]:
        b, t = self._step.mbs[m].inputs.shape
        return (b, t, self.model.hidden)

    def _peer_tag(self, a: Action) -> tuple[int, int]:
        """(mb, chunk) of the receiving action that a send pairs with (the wrap changes the chunk)."""
        _, match = peer(self.stage.stage, a, self.stage.num_stages, chunks=self.chunks)
        return match.mb, match.chunk

    def _group(self, kind: Kind):
        """The process group a communication action of this stage travels in (None: the default group)."""
        key = self.routes.group(kind)
        return self.comms.groups[key] if key is not None else None

    def _clock(self) -> float:
        """``perf_counter``; on CUDA, when tracing or emulating, once the device has done what was issued,
        so the times are the device's (this gives up the overlap of host and device while it is on)."""
        if self.comms.device.type == "cuda" and (self.trace is not None or self.emulation.active):
            torch.cuda.synchronize(self.comms.device)
        return time.perf_counter()

    def _await(self, direction: Direction, a: Action) -> torch.Tensor:
        """Wait for a received tensor; traced as its own event (the RECV's wait), not as compute."""
        t0 = self._clock()
        x = self._step.recvs.pop((direction, (a.mb, a.chunk))).wait(self.comms)
        if self.trace is not None:
            self.trace.append((str(Action(direction.recv, a.mb, a.chunk)), t0, self._clock()))
        return x

    def execute(self, a: Action) -> None:
        st, s = self.stage, self._step
        key = (a.mb, a.chunk)
        _, _, first, last = st.chunk_shape(a.chunk)
        received = None
        if a.kind is Kind.F and not first:
            received = self._await(Direction.FWD, a)
        elif a.kind in BACKWARD_KINDS and not last:
            received = self._await(Direction.BWD, a)
        if a.kind in COMPUTE_KINDS:  # benchmarks: the state as it is now (ZeRO-1's all-gather replaces parameters)
            tensor_meter.checkpoint(instant=True)
        t0 = self._clock()  # compute time excludes the wait: traces and emulation see compute only
        waited0 = self.tp_waits.seconds if self.tp_waits is not None else 0.0
        ring_waits = self.ring.waits if self.ring is not None else None
        ring0 = ring_waits.seconds if ring_waits is not None else 0.0
        if a.kind is Kind.RECV_F or a.kind is Kind.RECV_B:
            self._post_receive(a)
        elif a.kind is Kind.F:
            self._forward(a, received)
        elif a.kind is Kind.B:
            self._backward(a, received)
        elif a.kind is Kind.I:
            assert self._weight_grads is not None  # a schedule with I and W splits its backward (split_backward)
            with self._weight_grads.capturing(key):  # W computes what this backward leaves out
                self._backward(a, received)
        elif a.kind is Kind.W:
            assert self._weight_grads is not None
            self._weight_grads.flush(key)
        elif a.kind is Kind.SEND_F or a.kind is Kind.SEND_B:
            d = a.kind.direction
            assert d is not None
            tensor, routes = (
                (s.outputs[key], self.routes.send_f)
                if d is Direction.FWD
                else (s.grads_out.pop(key), self.routes.send_b)
            )
            mb, chunk = self._peer_tag(a)
            p2p.send_boundary(self.comms, tensor, list(routes), d, mb, chunk, self.streams, self._group(a.kind))
        elif a.kind in OPTIMIZER_KINDS:  # RS: start the reduce-scatters; AG: wait for the parameter all-gathers
            hook = self.optimizer_hooks.get(a.kind)
            if hook is not None:
                hook()
        else:
            raise NotImplementedError(f"action kind {a.kind.value} is not supported by the runtime")
        if a.kind in COMPUTE_KINDS:
            # benchmarks (HETERO_TENSOR_METER): what is held now, the gradients so far beside the activations (ZeRO-1's
            # RS frees the gradients before the step's checkpoint; the step's first forwards run before any exist)
            tensor_meter.checkpoint(instant=True)
        if a.kind in COMPUTE_KINDS and self.emulation.active:
            self._emulate(a, t0, waited0, ring_waits, ring0)
        if self.trace is not None:
            self.trace.append((str(a), t0, self._clock()))

    def _post_receive(self, a: Action) -> None:
        """Post the receive of ``RECV_F`` / ``RECV_B`` action ``a``; the compute action that needs it waits for it."""
        s, d = self._step, a.kind.direction
        assert d is not None  # a communication kind has a direction
        route = self.routes.recv_f if d is Direction.FWD else self.routes.recv_b
        runs = self.routes.recv_f_runs if d is Direction.FWD else self.routes.recv_b_runs
        shape, group = self._shape(a.mb), self._group(a.kind)

        def post(r, shape):
            return p2p.recv_boundary(self.comms, r, shape, s.dtype, d, a.mb, a.chunk, self.streams, group)

        s.recvs[(d, (a.mb, a.chunk))] = (
            post(route, shape)
            if route is not None  # else stages of different cp: this rank's positions from each sender
            else p2p.PendingRuns([post(r, p2p.runs_shape(r, shape)) for r in runs], shape)
        )

    def _emulate(self, a: Action, t0: float, waited0: float, ring_waits, ring0: float) -> None:
        """Stretch compute action ``a`` (begun at ``t0``; the TP waits then at ``waited0`` s, the ring's at ``ring0``)
        to the emulated device's duration; the ring's exposed transfers come on top: a modelled duration has no ring
        in it (context_rows.pace)."""
        spent = self._clock() - t0 - (ring_waits.seconds - ring0 if ring_waits is not None else 0.0)
        lasts = dict(self.emulation.seconds).get(a.kind) if self.emulation.device is None else self._modelled_seconds(a)
        if lasts is not None:  # a wait for a TP peer counts: the modelled duration includes TP's messages
            time.sleep(max(0.0, lasts - spent))
        else:  # stretch this rank's own compute only, never a wait for its TP peer (collectives.TpWaits)
            own = spent - (self.tp_waits.seconds - waited0 if self.tp_waits is not None else 0.0)
            time.sleep(max(0.0, own) * (self.emulation.slowdown - 1 + self._rng.uniform(0, self.emulation.jitter)))

    def _modelled_seconds(self, a: Action) -> float:
        """An emulated device's duration of compute action ``a`` (``predict.device.action_seconds``); on a CP rank
        that of its columns (``rows x T / cp`` positions) and of its queries' share of the rows' attention
        (``context_rows.attention_square``: its keys come from the whole row)."""
        mb = self._step.mbs[a.mb]
        rows, width = mb.inputs.shape
        if mb.ctx is not None:
            square = context_rows.attention_square(mb.ctx)
        else:
            square = mb.docs.square_sum if mb.docs is not None else rows * width * width
        lo, hi, _, head = self.stage.chunk_shape(a.chunk)
        device = self.emulation.device
        assert device is not None  # called for an emulated device only
        return action_seconds(
            self.model,
            a.kind.value,
            hi - lo,
            rows,
            width,
            square,
            self.stage.tp,
            head,
            device,
            recompute=self.compute.recompute,
        )

    def _forward(self, a: Action, received: torch.Tensor | None) -> None:
        s = self._step
        key = (a.mb, a.chunk)
        lo, hi, first, last = self.stage.chunk_shape(a.chunk)
        if first:
            x = s.mbs[a.mb].inputs.to(self.comms.device)
        else:
            assert received is not None  # a later chunk's forward waited for its input (execute)
            x = received.requires_grad_()
        s.inputs[key] = x
        out = stage_forward(
            self.params,
            x,
            StageShape(lo, hi, first, last),
            self.model,
            self.tp,
            self.compute,
            self._block_fn,
            self._linear,
            s.mbs[a.mb].docs,
            s.mbs[a.mb].ctx,
        )
        if last:
            loss = token_loss_sum(out, s.mbs[a.mb].targets.to(self.comms.device))
            s.loss += loss.detach().double()
            out = loss / s.tokens  # mean over the GLOBAL batch: pipelines' gradients then sum
        s.outputs[key] = out

    def _backward(self, a: Action, received: torch.Tensor | None) -> None:
        s = self._step
        key = (a.mb, a.chunk)
        _, _, first, last = self.stage.chunk_shape(a.chunk)
        out = s.outputs.pop(key)
        if last:
            out.backward()
        else:
            torch.autograd.backward(out, received)
        x = s.inputs.pop(key)
        if not first:
            s.grads_out[key] = x.grad

    def _finish(self) -> torch.Tensor:
        p2p.wait_sends(self.comms)
        s = self._step
        put_off = self._weight_grads.pending if self._weight_grads is not None else []
        if s.recvs or s.outputs or s.inputs or s.grads_out or put_off:
            receives = sorted((int(direction), key) for direction, key in s.recvs)  # printed as before: 0 fwd, 1 bwd
            raise RuntimeError(
                f"schedule left work undone: receives {receives}, outputs {sorted(s.outputs)}, "
                f"weight gradients {sorted(put_off)}"
            )
        return s.loss

    # -- whole steps ----------------------------------------------------------------------------

    def run(self, actions: tuple[Action, ...], microbatches: list[Microbatch], global_tokens: int) -> torch.Tensor:
        """Run a static schedule; returns this rank's summed token loss (0 off the last stage)."""
        self._begin(microbatches, global_tokens)
        for a in actions:
            self.execute(a)
        return self._finish()

    def run_forward(
        self, actions: tuple[Action, ...], microbatches: list[Microbatch], global_tokens: int
    ) -> torch.Tensor:
        """Forward only, without autograd (held-out loss): the schedule's forwards and their sends and receives,
        in its order (forward messages alone keep it deadlock-free); returns the summed token loss as ``run``.
        ZeRO-1's AG runs too: the parameters the last step updated are whole before the first forward (the next
        step's AG then has nothing to wait for)."""
        self._begin(microbatches, global_tokens)
        with torch.no_grad():
            for a in actions:
                if a.kind in (Kind.F, Kind.SEND_F, Kind.RECV_F, Kind.AG):
                    self.execute(a)
        self._step.inputs.clear()
        self._step.outputs.clear()
        return self._finish()

    # C901: one scheduling loop (MegatronDPP's policy: poll, choose, agree, run) whose counters its closures share;
    # the policy reads in one place
    def run_dynamic(self, microbatches: list[Microbatch], global_tokens: int) -> torch.Tensor:  # noqa: C901
        """MegatronDPP: run whichever ready action has the highest priority (see module doc)."""
        st = self.stage
        M = len(microbatches)
        window = st.num_stages - st.stage  # the 1F1B in-flight bound: same activation memory
        self._begin(microbatches, global_tokens)
        s = self._step
        next_f, next_recv_f, done = 0, 0, 0
        in_flight: list[int] = []  # microbatches forwarded, not yet backwarded
        if self.optimizer_hooks:
            self.execute(Action(Kind.AG, 0))  # this step's parameters, before any forward
        leader = self.comms.tp_group is None or collectives.tp_index(self.comms) == 0
        leader = leader and (self.ring is None or self.ring.index == 0)  # one rank of the stage's TP x CP decides
        arrival = threading.Event()  # set by the receive watchers

        def post_forward_receives():
            nonlocal next_recv_f
            while not st.first and next_recv_f < min(M, next_f + window):
                self.execute(Action(Kind.RECV_F, next_recv_f))
                s.recvs[(Direction.FWD, (next_recv_f, 0))].watch(arrival)
                next_recv_f += 1

        def ready(kind: Kind, m: int) -> bool:
            if kind is Kind.F:
                return st.first or s.recvs[(Direction.FWD, (m, 0))].arrived()
            return st.last or s.recvs[(Direction.BWD, (m, 0))].arrived()

        while done < M:
            post_forward_receives()
            choice: tuple[Kind, int] | None = None
            if leader:
                while choice is None:
                    arrival.clear()  # cleared before the polls: an arrival after them wakes the wait below
                    choice = next(((Kind.B, m) for m in in_flight if ready(Kind.B, m)), None)
                    if choice is None and next_f < M and len(in_flight) < window and ready(Kind.F, next_f):
                        choice = (Kind.F, next_f)
                    if choice is None:
                        # Nothing is ready: sleep until a watcher sees an arrival instead of spinning, which
                        # would steal the core from other ranks (polling NCCL work: a short timeout).
                        arrival.wait(0.0005 if self.comms.device.type == "cuda" else 0.05)
            if self.comms.tp_group is not None and (self.ring is None or self.ring.index == 0):
                choice = collectives.tp_agree(self.comms, choice)
            if self.ring is not None:  # then CP rank 0's TP group to the other CP ranks, each TP index in its ring
                choice = context_rows.cp_agree(self.ring, choice, self.comms.device)
            assert choice is not None  # the leader chose (a rank alone in its TP x CP group is its own leader)
            kind, m = choice
            if kind is Kind.F:
                self.execute(Action(Kind.F, m))
                if not st.last:
                    self.execute(Action(Kind.SEND_F, m))
                    self.execute(Action(Kind.RECV_B, m))  # post the gradient receive right away
                    s.recvs[(Direction.BWD, (m, 0))].watch(arrival)
                in_flight.append(m)
                next_f += 1
            else:
                self.execute(Action(Kind.B, m))
                if not st.first:
                    self.execute(Action(Kind.SEND_B, m))
                in_flight.remove(m)
                done += 1
        if self.optimizer_hooks:
            self.execute(Action(Kind.RS, 0))
        return self._finish()
