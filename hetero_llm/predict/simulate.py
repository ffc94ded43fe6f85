"""Cost-model simulation of a schedule: step time, bubbles, activation memory, a timeline.

The simulator executes the same semantics as the validator (``schedule.requirements``, read in
the lockstep order of ``schedule.simulate_order``, which is a topological order of all events),
now with durations:

- compute (``F``, ``B``, or ``I`` and ``W``) runs one at a time per stage, in list order, starting when the
  stage is free and everything it requires is done;
- a ``SEND`` is posted when its compute is done and does not occupy the stage; its data arrives
  ``latency + activation_bytes / bandwidth`` seconds after it starts (links are not shared: two
  sends on one link do not slow each other down);
- a ``RECV`` holds its stage until the data has arrived (that wait is pipeline bubble); with
  ``CostModel.rendezvous`` (gloo over a network) the data moves only once the receive is posted, so it arrives a latency
  (the receiver's notice to the sender) + the transfer after the post at the earliest;
- in a compute-only schedule the transfer is implicit: ``F m`` on stage s starts at the earliest
  when ``F m`` on s-1 has ended plus the transfer time (and likewise backwards);
- ZeRO-1 (``docs/zero1.md``): ``AG`` holds its stage until the parameter all-gather, started at the step's
  start (right after the last step's update), has taken ``all_gather`` seconds; ``RS`` starts the
  reduce-scatter, which takes ``reduce_scatter`` seconds without occupying the stage, and the step ends
  when the last one has (the optimizer needs every slice's summed gradient).

A deadlocking schedule raises the validator's ScheduleError (the grid with the stuck steps marked).
A hot-switching step (buckets, switches, home sync) and emulated devices are simulated in ``switching.predict``.
Pure standard library + attrs, like ``schedule``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from hetero_llm.schedule import (
    COMPUTE_KINDS,
    Action,
    Event,
    Kind,
    num_chunks,
    peer,
    produces,
    requirements,
    simulate_order,
    validate,
)
from hetero_llm.schedule.ir import is_lowered

__all__ = ["CostModel", "SimResult", "Timed", "simulate"]


def _floats(value: Sequence[float]) -> tuple[float, ...]:
    return tuple(float(x) for x in value)


def _optional_floats(value: Sequence[float] | None) -> tuple[float, ...] | None:
    return None if value is None else _floats(value)


def _non_negative(instance, attribute, value) -> None:
    if value is None:
        return
    values = value if isinstance(value, tuple) else (value,)
    for index, x in enumerate(values):
        if not x >= 0:  # also catches NaN
            where = f"[{index}]" if isinstance(value, tuple) else ""
            raise ValueError(f"CostModel.{attribute.name}{where} must be >= 0, got {x}")


def _positive(instance, attribute, value) -> None:
    for index, x in enumerate(value):
        if not x > 0:
            raise ValueError(f"CostModel.{attribute.name}[{index}] must be > 0 bytes/s (math.inf: free), got {x}")


@attrs.frozen
class CostModel:
    """Per-stage compute times and per-boundary link costs, in seconds and bytes.

    Stage times are for one microbatch through *all* of a stage's layers; in an interleaved
    schedule each of a stage's ``chunks`` model chunks takes ``1 / chunks`` of them.

    Links: entry b of ``latency`` and ``bandwidth`` is the link between stage b and stage b + 1
    (both directions). An interleaved schedule also sends from the last stage back to stage 0 (the
    wrap); give one more entry, the last, for that link (``uniform`` does). With two stages the wrap
    is the one link there is.
    """

    forward: tuple[float, ...] = attrs.field(converter=_floats, validator=_non_negative)
    """Seconds of one microbatch's forward, per stage."""
    backward: tuple[float, ...] = attrs.field(converter=_floats, validator=_non_negative)
    """Seconds of one microbatch's full backward (input and weight gradients), per stage."""
    latency: tuple[float, ...] = attrs.field(converter=_floats, validator=_non_negative)
    """Seconds from a send's start until its first byte arrives, per link."""
    bandwidth: tuple[float, ...] = attrs.field(converter=_floats, validator=_positive)
    """Bytes per second, per link (``math.inf``: transfers take only their latency)."""
    activation_bytes: float = attrs.field(default=0.0, converter=float, validator=_non_negative)
    """Bytes of one microbatch's boundary activation; its gradient going back is the same size."""
    weight: tuple[float, ...] | None = attrs.field(default=None, converter=_optional_floats, validator=_non_negative)
    """Seconds of the weight-gradient part of ``backward``, per stage (None: no split backwards).
    When a schedule splits a backward into ``I`` and ``W``, ``I`` takes ``backward - weight``."""
    stash_bytes: tuple[float, ...] | None = attrs.field(
        default=None, converter=_optional_floats, validator=_non_negative
    )
    """Bytes a stage keeps per in-flight microbatch for its backward, per stage
    (None: ``activation_bytes``)."""
    overhead: tuple[float, ...] | None = attrs.field(default=None, converter=_optional_floats, validator=_non_negative)
    """Seconds a stage's runtime spends around each compute action, per stage (posting its sends and
    receives, the interpreter between actions), added to every ``F``, ``B``, ``I`` and ``W``
    (None: none). Small next to GPU compute; on shared CPU cores it is a large part of a step."""

    reduce_scatter: tuple[float, ...] | None = attrs.field(
        default=None, converter=_optional_floats, validator=_non_negative
    )
    """Seconds of a stage's ZeRO-1 gradient reduce-scatter (the ``RS`` action), per stage (None: 0)."""
    all_gather: tuple[float, ...] | None = attrs.field(
        default=None, converter=_optional_floats, validator=_non_negative
    )
    """Seconds of a stage's ZeRO-1 parameter all-gather (waited for at ``AG``), per stage (None: 0)."""
    rendezvous: tuple[bool, ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else tuple(bool(x) for x in v)
    )
    """Per link, whether a message moves only once its receive is posted (gloo over the network: the sender
    waits for the receiver's notice; a shared-memory ring does not). A stage posts a receive when it reaches
    it (right before the compute that needs it), so over such a link the data is there ``latency`` (the
    notice) + the transfer after the post at the earliest, however early it was sent (None: no such link)."""

    def __attrs_post_init__(self) -> None:
        num_stages = len(self.forward)
        if num_stages < 1:
            raise ValueError("CostModel needs at least one stage (forward is empty)")
        for name in ("backward", "weight", "stash_bytes", "overhead", "reduce_scatter", "all_gather"):
            value = getattr(self, name)
            if value is not None and len(value) != num_stages:
                raise ValueError(f"CostModel.{name} has {len(value)} entries, forward has {num_stages} (one per stage)")
        for name in ("latency", "bandwidth", "rendezvous"):
            value = getattr(self, name)
            if value is None:
                continue
            if len(value) not in (num_stages - 1, num_stages):
                raise ValueError(
                    f"CostModel.{name} has {len(value)} entries; {num_stages} stages have "
                    f"{num_stages - 1} links (one more for an interleaved schedule's wrap link)"
                )
        for name in ("bandwidth", "rendezvous"):
            value = getattr(self, name)
            if value is not None and len(value) != len(self.latency):
                raise ValueError(
                    f"CostModel.latency has {len(self.latency)} entries but {name} has {len(value)} (one per link)"
                )
        if self.weight is not None:
            for stage, (w, b) in enumerate(zip(self.weight, self.backward)):
                if w > b:
                    raise ValueError(
                        f"CostModel.weight[{stage}] = {w} s exceeds backward[{stage}] = {b} s "
                        "(weight is the weight-gradient part of the backward)"
                    )

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        forward: float,
        backward: float,
        *,
        latency: float = 0.0,
        bandwidth: float = math.inf,
        activation_bytes: float = 0.0,
        weight: float | None = None,
    ) -> CostModel:
        """Equal stages and equal links (including the wrap link of interleaved schedules)."""
        return cls(
            forward=[forward] * num_stages,
            backward=[backward] * num_stages,
            latency=[latency] * num_stages,
            bandwidth=[bandwidth] * num_stages,
            activation_bytes=activation_bytes,
            weight=None if weight is None else [weight] * num_stages,
        )

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def link(self, src: int, dst: int) -> int:
        """Index of the link between two stages (``num_stages - 1`` is the wrap link)."""
        if abs(src - dst) == 1:
            return min(src, dst)
        return self.num_stages - 1

    def posted(self, src: int, dst: int) -> float:
        """Seconds from posting a receive on ``dst`` until the data from ``src`` is there, at the earliest
        (``rendezvous``: the notice to the sender, then the transfer; else 0)."""
        if self.rendezvous is None or src == dst or not self.rendezvous[self.link(src, dst)]:
            return 0.0
        return self.latency[self.link(src, dst)] + self.transfer(src, dst)

    def transfer(self, src: int, dst: int) -> float:
        """Seconds from a send's start on ``src`` until its data is on ``dst``."""
        if src == dst:
            return 0.0  # a one-stage interleaved schedule hands data to itself
        link = self.link(src, dst)
        if link >= len(self.latency):
            raise ValueError(
                f"the schedule sends between stage {src} and stage {dst} (the interleaved wrap "
                f"link), but CostModel has only {len(self.latency)} links: add one more "
                "latency and bandwidth entry for it"
            )
        return self.latency[link] + self.activation_bytes / self.bandwidth[link]


@attrs.frozen
class Timed:
    """One action's simulated interval on its stage, in seconds from the step start.

    For a ``SEND``, ``end`` is when its data has arrived (the stage does not wait for it);
    for a ``RECV``, ``start`` is when the stage reached it and ``end`` when the data was there.
    """

    action: Action
    start: float
    end: float


@attrs.frozen
class SimResult:
    """What ``simulate`` predicts for one step of one pipeline."""

    step_time: float
    """Seconds from the first action's start to the last one's end."""
    busy: tuple[float, ...]
    """Seconds each stage computes (``F``, ``B``, ``I``, ``W``)."""
    bubble: tuple[float, ...]
    """Idle fraction per stage: ``1 - busy / step_time``."""
    peak_in_flight: tuple[int, ...]
    """Most (microbatch, chunk) pairs per stage whose forward has run and backward (``B``, or the
    ``W`` of a split one) has not: a split backward keeps the ``W``'s inputs until the ``W``."""
    peak_activation_bytes: tuple[float, ...]
    """``peak_in_flight * stash bytes / chunks`` per stage (a chunk holds 1/chunks of the layers)."""
    timeline: tuple[tuple[Timed, ...], ...]
    """Per stage, every action in list order."""

    @property
    def num_stages(self) -> int:
        return len(self.busy)

    @property
    def mean_bubble(self) -> float:
        """Idle fraction of all stages together."""
        return 1.0 - sum(self.busy) / (self.num_stages * self.step_time) if self.step_time else 0.0

    def rows(self) -> list[list[tuple[str, float, float]]]:
        """Per stage ``(action string, start s, end s)``: the input of ``timeline.plot_timeline``."""
        return [[(str(t.action), t.start, t.end) for t in stage] for stage in self.timeline]

    def summary(self) -> str:
        """A small table: step time, then per stage busy time, bubble and peak activations."""
        lines = [
            f"step time {self.step_time * 1e3:.3f} ms, mean bubble {self.mean_bubble:.1%}",
            "stage  busy ms    bubble  peak in flight  peak activation bytes",
        ]
        for stage in range(self.num_stages):
            lines.append(
                f"{stage:<6} {self.busy[stage] * 1e3:<10.3f} {self.bubble[stage]:<7.1%} "
                f"{self.peak_in_flight[stage]:<15} {self.peak_activation_bytes[stage]:.4g}"
            )
        return "\n".join(lines)


def simulate(schedule: Sequence[Sequence[Action]], cost: CostModel) -> SimResult:
    """Predict one step of ``schedule`` (lowered or compute-only) under ``cost``.

    Raises ScheduleError for an invalid or deadlocking schedule (with the grid, stuck steps
    marked), ValueError when ``cost`` does not fit the schedule.
    """
    num_stages = len(schedule)
    if cost.num_stages != num_stages:
        raise ValueError(f"CostModel has {cost.num_stages} stages, the schedule has {num_stages}")
    num_microbatches = 1 + max((a.mb for actions in schedule for a in actions), default=0)
    validate(schedule, num_microbatches)
    order = simulate_order(schedule)
    chunks = num_chunks(schedule)
    lowered = is_lowered(schedule)  # as the validator reads it: RS/AG alone are no communication
    if cost.weight is None and any(a.kind is Kind.W for actions in schedule for a in actions):
        raise ValueError("the schedule has W actions: give CostModel.weight (seconds per stage)")

    free = [0.0] * num_stages  # when each stage's previous action ended
    ended: dict[Event, float] = {}
    arrives: dict[Event, float] = {}  # SEND (or compute-only output) -> when data is on the peer
    timed: list[list[Timed | None]] = [[None] * len(actions) for actions in schedule]
    for round_ in order:
        for stage, index in round_:
            action = schedule[stage][index]
            ready = free[stage]
            for other, needed in requirements(stage, action, num_stages, lowered=lowered, chunks=chunks):
                if other == stage:
                    ready = max(ready, ended[(other, needed)])
                elif lowered:  # a RECV, posted when its stage is free: its SEND's data must have arrived
                    ready = max(ready, arrives[(other, needed)], free[stage] + cost.posted(other, stage))
                else:  # compute-only: the transfer (and its receive, posted when the stage is free) is implicit
                    ready = max(ready, ended[(other, needed)] + cost.transfer(other, stage))
                    ready = max(ready, free[stage] + cost.posted(other, stage))
            if action.kind is Kind.RS:
                start, end = ready, ready + (cost.reduce_scatter[stage] if cost.reduce_scatter else 0.0)
                free[stage] = start
            elif action.kind is Kind.AG:
                start = free[stage]
                end = max(start, cost.all_gather[stage] if cost.all_gather else 0.0)
                free[stage] = end
            elif action.kind is Kind.SEND_F or action.kind is Kind.SEND_B:
                destination, _ = peer(stage, action, num_stages, chunks=chunks)
                start, end = ready, ready + cost.transfer(stage, destination)
                arrives[(stage, action)] = end
                free[stage] = start
            elif action.kind is Kind.RECV_F or action.kind is Kind.RECV_B:
                start, end = free[stage], ready
                free[stage] = end
            else:
                start = ready
                end = start + _duration(cost, chunks, stage, action)
                free[stage] = end
            for event in produces(stage, action):
                ended[event] = end
            timed[stage][index] = Timed(action, start, end)

    timeline = tuple(tuple(t for t in stage if t is not None) for stage in timed)
    step_time = max((t.end for stage in timeline for t in stage), default=0.0)
    busy = tuple(sum(t.end - t.start for t in stage if t.action.kind in COMPUTE_KINDS) for stage in timeline)
    bubble = tuple(1.0 - b / step_time if step_time else 0.0 for b in busy)
    peaks = tuple(_peak_in_flight(actions) for actions in schedule)
    stash = cost.stash_bytes or (cost.activation_bytes,) * num_stages
    peak_bytes = tuple(peak * stash[stage] / chunks for stage, peak in enumerate(peaks))
    return SimResult(step_time, busy, bubble, peaks, peak_bytes, timeline)


def _duration(cost: CostModel, chunks: int, stage: int, action: Action) -> float:
    """Seconds of compute action ``action`` on ``stage`` (a chunk's share of the stage's), with its overhead."""
    if action.kind is Kind.F:
        compute = cost.forward[stage] / chunks
    elif action.kind is Kind.B:
        compute = cost.backward[stage] / chunks
    else:
        assert cost.weight is not None  # checked by simulate: the schedule splits backwards
        weight = cost.weight[stage]
        compute = (cost.backward[stage] - weight if action.kind is Kind.I else weight) / chunks
    return compute + (cost.overhead[stage] if cost.overhead is not None else 0.0)


def _peak_in_flight(actions: Sequence[Action]) -> int:
    live = peak = 0
    for action in actions:
        if action.kind is Kind.F:
            live += 1
            peak = max(peak, live)
        elif action.kind is Kind.B or action.kind is Kind.W:
            live -= 1
    return peak
