"""Cost-model simulation of a schedule: step time, bubbles, activation memory, a timeline.

The simulator executes the same semantics as the validator (``schedule.requirements``, read in
the lockstep order of ``schedule.simulate_order``, which is a topological order of all events),
now with durations:

- compute (``F``, ``B``, or ``I`` and ``W``) runs one at a time per stage, in list order, starting when the
  stage is free and everything it requires is done;
- a ``SEND`` is posted when its compute is done and does not occupy the stage; its data arrives
  ``latency + activation_bytes / bandwidth`` seconds after it starts (links are not shared: two
  sends on one link do not slow each other down);
- a ``RECV`` holds its stage until the data has arrived (that wait is pipeline bubble);
- in a compute-only schedule the transfer is implicit: ``F m`` on stage s starts at the earliest
  when ``F m`` on s-1 has ended plus the transfer time (and likewise backwards);
- ZeRO-1 (``docs/zero1.md``): ``AG`` holds its stage until the parameter all-gather, started at the step's
  start (right after the last step's update), has taken ``all_gather`` seconds; ``RS`` starts the
  reduce-scatter, which takes ``reduce_scatter`` seconds without occupying the stage, and the step ends
  when the last one has (the optimizer needs every slice's summed gradient).

A deadlocking schedule raises the validator's ScheduleError (the grid with the stuck steps marked).
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

__all__ = ["BucketStep", "CostModel", "EmulatedDevice", "SimResult", "Timed", "action_seconds", "simulate",
           "simulate_buckets", "switch_seconds", "describe_bucket_step", "link_costs"]


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
            raise ValueError(
                f"CostModel.{attribute.name}[{index}] must be > 0 bytes/s (math.inf: free), got {x}"
            )


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
    weight: tuple[float, ...] | None = attrs.field(
        default=None, converter=_optional_floats, validator=_non_negative
    )
    """Seconds of the weight-gradient part of ``backward``, per stage (None: no split backwards).
    When a schedule splits a backward into ``I`` and ``W``, ``I`` takes ``backward - weight``."""
    stash_bytes: tuple[float, ...] | None = attrs.field(
        default=None, converter=_optional_floats, validator=_non_negative
    )
    """Bytes a stage keeps per in-flight microbatch for its backward, per stage
    (None: ``activation_bytes``)."""
    overhead: tuple[float, ...] | None = attrs.field(
        default=None, converter=_optional_floats, validator=_non_negative
    )
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

    def __attrs_post_init__(self) -> None:
        num_stages = len(self.forward)
        if num_stages < 1:
            raise ValueError("CostModel needs at least one stage (forward is empty)")
        for name in ("backward", "weight", "stash_bytes", "overhead", "reduce_scatter", "all_gather"):
            value = getattr(self, name)
            if value is not None and len(value) != num_stages:
                raise ValueError(
                    f"CostModel.{name} has {len(value)} entries, forward has {num_stages} "
                    "(one per stage)"
                )
        for name in ("latency", "bandwidth"):
            value = getattr(self, name)
            if len(value) not in (num_stages - 1, num_stages):
                raise ValueError(
                    f"CostModel.{name} has {len(value)} entries; {num_stages} stages have "
                    f"{num_stages - 1} links (one more for an interleaved schedule's wrap link)"
                )
        if len(self.latency) != len(self.bandwidth):
            raise ValueError(
                f"CostModel.latency has {len(self.latency)} entries but bandwidth has "
                f"{len(self.bandwidth)} (one per link)"
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
        raise ValueError(
            f"CostModel has {cost.num_stages} stages, the schedule has {num_stages}"
        )
    num_microbatches = 1 + max((a.mb for actions in schedule for a in actions), default=0)
    validate(schedule, num_microbatches)
    order = simulate_order(schedule)
    chunks = num_chunks(schedule)
    lowered = is_lowered(schedule)  # as the validator reads it: RS/AG alone are no communication
    if cost.weight is None and any(a.kind is Kind.W for actions in schedule for a in actions):
        raise ValueError("the schedule has W actions: give CostModel.weight (seconds per stage)")

    def compute(stage: int, action: Action) -> float:
        if action.kind is Kind.F:
            return cost.forward[stage] / chunks
        if action.kind is Kind.B:
            return cost.backward[stage] / chunks
        weight = cost.weight[stage]  # type: ignore[index]  (checked above: the schedule splits backwards)
        return (cost.backward[stage] - weight if action.kind is Kind.I else weight) / chunks

    def duration(stage: int, action: Action) -> float:
        return compute(stage, action) + (cost.overhead[stage] if cost.overhead is not None else 0.0)

    free = [0.0] * num_stages  # when each stage's previous action ended
    ended: dict[Event, float] = {}
    arrives: dict[Event, float] = {}  # SEND (or compute-only output) -> when data is on the peer
    timed: list[list[Timed | None]] = [[None] * len(actions) for actions in schedule]
    for round_ in order:
        for stage, index in round_:
            action = schedule[stage][index]
            ready = free[stage]
            for other, needed in requirements(
                stage, action, num_stages, lowered=lowered, chunks=chunks
            ):
                if other == stage:
                    ready = max(ready, ended[(other, needed)])
                elif lowered:  # a RECV: its SEND's data must have arrived
                    ready = max(ready, arrives[(other, needed)])
                else:  # compute-only: the transfer is implicit
                    ready = max(ready, ended[(other, needed)] + cost.transfer(other, stage))
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
                end = start + duration(stage, action)
                free[stage] = end
            for event in produces(stage, action):
                ended[event] = end
            timed[stage][index] = Timed(action, start, end)

    timeline = tuple(tuple(t for t in stage if t is not None) for stage in timed)
    step_time = max((t.end for stage in timeline for t in stage), default=0.0)
    busy = tuple(
        sum(t.end - t.start for t in stage if t.action.kind in COMPUTE_KINDS) for stage in timeline
    )
    bubble = tuple(1.0 - b / step_time if step_time else 0.0 for b in busy)
    peaks = tuple(_peak_in_flight(actions) for actions in schedule)
    stash = cost.stash_bytes or (cost.activation_bytes,) * num_stages
    peak_bytes = tuple(peak * stash[stage] / chunks for stage, peak in enumerate(peaks))
    return SimResult(step_time, busy, bubble, peaks, peak_bytes, timeline)


def _peak_in_flight(actions: Sequence[Action]) -> int:
    live = peak = 0
    for action in actions:
        if action.kind is Kind.F:
            live += 1
            peak = max(peak, live)
        elif action.kind is Kind.B or action.kind is Kind.W:
            live -= 1
    return peak


# --------------------------------------------------------------------------------------------------
# Emulated devices and hot-switching steps (docs/hot_switching.md): the cost of one compute action from
# its microbatch, and a bucketed step (each bucket's schedule, the switches between layouts, home sync).
# --------------------------------------------------------------------------------------------------

FLOAT32_BYTES = 4


@attrs.frozen
class EmulatedDevice:
    """A modelled device: compute speed, the link its TP group all-reduces over (inside compute actions),
    and the costs a switch pays (``switch_seconds``). ``HETERO_EMULATE_DEVICE`` gives one to the runtime
    (``RANK:gflops=..;tp_gbps=..;tp_latency_us=..``), which then makes every compute action last
    ``action_seconds`` (the real computation runs inside it, the rank sleeps the rest)."""

    flops: float  # FLOP/s of one device
    tp_bandwidth: float = math.inf  # bytes/s of the TP group's link
    tp_latency: float = 0.0  # seconds per TP all-reduce

    KEYS = {"gflops": ("flops", 1e9), "tp_gbps": ("tp_bandwidth", 1e9 / 8), "tp_latency_us": ("tp_latency", 1e-6)}

    @classmethod
    def parse(cls, spec: str) -> EmulatedDevice:
        """From ``gflops=2;tp_gbps=0.5;tp_latency_us=100`` (gflops required); ValueError naming a bad key."""
        values: dict[str, float] = {}
        for item in filter(None, (x.strip() for x in spec.split(";"))):
            key, _, value = item.partition("=")
            if key.strip() not in cls.KEYS:
                raise ValueError(f"emulated device: unknown key {key.strip()!r} (known: {', '.join(cls.KEYS)})")
            name, scale = cls.KEYS[key.strip()]
            try:
                values[name] = float(value) * scale
            except ValueError:
                raise ValueError(f"emulated device: {key.strip()} = {value!r} is not a number") from None
            if not values[name] >= 0:
                raise ValueError(f"emulated device: {key.strip()} must be >= 0, got {value}")
        if not values.get("flops", 0) > 0:
            raise ValueError(f"emulated device {spec!r}: gflops > 0 is required")
        if values.get("tp_bandwidth", 1) == 0:
            raise ValueError("emulated device: tp_gbps must be > 0")
        return cls(**values)


def action_seconds(model, kind: str, layers: int, rows: int, width: int, square_sum: int, tp: int, head: bool,
                   device: EmulatedDevice) -> float:
    """Modelled seconds of one compute action (``F``, ``B``, ``I`` or ``W``) over ``layers`` blocks of a
    microbatch of ``rows`` x ``width`` positions on one device of a TP group of ``tp``.

    The planner's FLOP conventions (planner/cost.py): per position and layer ``8 H^2 + 2 nm H F`` of
    matmuls (every position, padding included), attention ``2 H`` times the **sum of squared document
    lengths** (``square_sum``: document masks; ``rows * width^2`` without them), the head ``2 H V`` per
    position; split over the TP group. A backward is twice the forward, its weight-gradient part (``W``)
    the matmuls' forward, ``I`` the rest. With TP, each layer all-reduces its activations twice forward
    and twice backward (``I``), ring all-reduce over ``device.tp_bandwidth`` plus ``tp_latency`` each."""
    h, f = model.hidden, model.ffn_width
    nm = 3 if getattr(model.mlp, "value", model.mlp) == "swiglu" else 2
    positions = rows * width
    matmul = layers * positions * (8 * h * h + 2 * nm * h * f) + (2 * positions * h * model.vocab if head else 0)
    forward = matmul + layers * 2 * h * square_sum
    compute = {"F": forward, "B": 2 * forward, "W": matmul, "I": 2 * forward - matmul}[kind] / (tp * device.flops)
    if tp == 1 or kind == "W":
        return compute
    nbytes = positions * h * FLOAT32_BYTES
    one = 2 * (tp - 1) / tp * nbytes / device.tp_bandwidth + device.tp_latency
    return compute + 2 * layers * one


@attrs.frozen
class BucketStep:
    """What ``simulate_buckets`` predicts for one hot-switching step (seconds)."""

    buckets: tuple[float | None, ...]  # each bucket's schedule time (None: no documents, skipped)
    switches: tuple[tuple[str, str, float], ...]  # (from, to, seconds) in step order
    home_sync: float  # the home layout's gradient all-reduce across pipelines

    @property
    def total(self) -> float:
        return sum(b for b in self.buckets if b) + sum(s for _, _, s in self.switches) + self.home_sync

    def describe(self) -> str:
        lines = [f"predicted step {self.total * 1e3:.1f} ms: buckets "
                 + ", ".join("-" if b is None else f"{b * 1e3:.1f}" for b in self.buckets) + " ms, switches "
                 + ", ".join(f"{a}->{b} {s * 1e3:.2f}" for a, b, s in self.switches) + " ms, home gradient sync "
                 + f"{self.home_sync * 1e3:.2f} ms"]
        return "\n".join(lines)


def switch_seconds(plan, links: dict[str, tuple[float, float]], copy_bandwidth: float = math.inf,
                   block_overhead: float = 0.0) -> float:
    """Seconds of one batched switch (``switch.SwitchPlan``): every device at once, each paying, per
    device-pair message it sends or receives, the latency of that pair's link (``links``: link kind ->
    (latency s, bytes/s), kinds as ``switch.LINKS``), the larger of its sent and received bytes over each
    link kind (a device's sends and receives overlap), its local copies over ``copy_bandwidth`` and
    ``block_overhead`` per transfer it takes part in. The slowest device is the switch's time."""
    per_device: dict[str, float] = {}
    sent: dict[tuple[str, str], int] = {}
    received: dict[tuple[str, str], int] = {}
    for (src, dst), transfers in plan.messages().items():
        kind = plan.link_of[(src, dst)]
        latency, _ = links[kind]
        for device in (src, dst):
            per_device[device] = per_device.get(device, 0.0) + latency
        nbytes = sum(t.nbytes for t in transfers)
        sent[(src, kind)] = sent.get((src, kind), 0) + nbytes
        received[(dst, kind)] = received.get((dst, kind), 0) + nbytes
    for device, kind in set(sent) | set(received):
        busiest = max(sent.get((device, kind), 0), received.get((device, kind), 0))
        per_device[device] = per_device.get(device, 0.0) + busiest / links[kind][1]
    for t in plan.transfers:
        if t.local:
            per_device[t.src] = per_device.get(t.src, 0.0) + t.nbytes / copy_bandwidth
        for device in {t.src, t.dst}:
            per_device[device] = per_device.get(device, 0.0) + block_overhead
    return max(per_device.values(), default=0.0)


def _pipeline_seconds(plan, pipeline: int, pieces: list, device: EmulatedDevice,
                      links: dict[str, tuple[float, float]]) -> float:
    """One pipeline of ``plan`` over its microbatches ``pieces`` (``documents.PackedRows``), simulated."""
    stages = sorted((s for s in plan.stages if s.pipeline == pipeline), key=lambda s: s.stage)
    model = plan.layout.model
    forward, backward, weight = [], [], []
    for st in stages:
        chunks = len(st.chunk_ranges)
        per = {k: 0.0 for k in "FBW"}
        for piece in pieces:
            rows, width = piece.inputs.shape
            square = int((piece.spans[:, 2].astype("int64") ** 2).sum())
            for c in range(chunks):
                lo, hi, _, head = st.chunk_shape(c)
                for k in per:
                    per[k] += action_seconds(model, k, hi - lo, rows, width, square, st.tp, head, device)
        forward.append(per["F"] / len(pieces))
        backward.append(per["B"] / len(pieces))
        weight.append(min(per["W"], per["B"]) / len(pieces))
    rows, width = pieces[0].inputs.shape
    node_of = [plan.ranks[s.ranks[0]].device_id.partition(":")[0] for s in stages]
    kinds = ["node" if a == b else "domain" for a, b in zip(node_of, node_of[1:] + node_of[:1])]
    if len(stages) == 1:
        kinds = ["node"]
    cost = CostModel(forward=forward, backward=backward, weight=weight,
                     latency=[links[k][0] for k in kinds], bandwidth=[links[k][1] for k in kinds],
                     activation_bytes=rows * width * model.hidden * FLOAT32_BYTES)
    schedule = [plan.actions(s.ranks[0]) for s in stages]
    return simulate(schedule, cost).step_time


def simulate_buckets(layout, step: int, device: EmulatedDevice, links: dict[str, tuple[float, float]], *,
                     copy_bandwidth: float = math.inf, block_overhead: float = 0.0, source=None) -> BucketStep:
    """Predict one hot-switching step of a layout with ``[[buckets]]``: the step's documents (the ones
    ``hotswitch`` trains on: ``documents.fill_documents`` of (seed, step)) sorted into buckets and packed
    as the runtime packs them; each bucket with documents simulated under its layout (``simulate`` per
    pipeline, with ``action_seconds`` on ``device``; the slowest pipeline is the bucket's time); the
    switches the step makes (``switch.step_switch``, priced by ``switch_seconds``); the home layout's
    gradient all-reduce across its pipelines (ring, over the slowest link among them). Torch-free."""
    from hetero_llm import documents
    from hetero_llm.plan import compile_plan
    from hetero_llm.switch import bucket_plans, step_switch

    home = compile_plan(layout)
    plans = bucket_plans(layout)
    if source is None:
        source = documents.make_document_source(layout.data, layout.model.seq_len, layout.file)
    docs = documents.fill_documents(source, layout.train.seed, step, layout.train.global_batch, layout.model.seq_len)
    times: list[float | None] = []
    switches: list[tuple[str, str, float]] = []
    current, current_name, accumulated = home, "home", False
    for i, (plan, rows) in enumerate(zip(plans, documents.bucket_rows(layout, docs))):
        if rows is None:
            times.append(None)
            continue
        name = "home" if not layout.buckets[i].pipelines else f"b{i}"
        if plan.layout.pipelines != current.layout.pipelines:
            sw = step_switch(home, current, plan, params=bool(layout.buckets[i].pipelines), grads=accumulated)
            switches.append((current_name, name, switch_seconds(sw, links, copy_bandwidth, block_overhead)))
        lay = plan.layout
        scale = rows.num_rows // sum(p.batch for p in lay.pipelines)
        slowest, offset = 0.0, 0
        for j, pipe in enumerate(lay.pipelines):
            pieces = rows.share(offset, pipe.batch * scale, pipe.microbatches)
            offset += pipe.batch * scale
            slowest = max(slowest, _pipeline_seconds(plan, j, pieces, device, links))
        times.append(slowest)
        current, current_name, accumulated = plan, name, True
    if current.layout.pipelines != home.layout.pipelines:
        sw = step_switch(home, current, home, params=False, grads=accumulated)
        switches.append((current_name, "home", switch_seconds(sw, links, copy_bandwidth, block_overhead)))
    return BucketStep(tuple(times), tuple(switches), _home_sync_seconds(home, links))


DRY_RUN_DEVICE = "gflops=100"  # the modelled device of --dry-run's predictions when HETERO_EMULATE_DEVICE names none
NODE_LINK = (20e-6, 10e9)  # (latency s, bytes/s) inside a node when nothing declares it
COPY_BANDWIDTH = 10e9  # bytes/s of a local block copy


def link_costs(layout) -> dict[str, tuple[float, float]]:
    """(latency s, bytes/s) per switch link kind (``switch.LINKS``) from a layout's ``[cluster]``: a node's own
    link ``NODE_LINK``; inside a domain the slowest declared domain's NIC; across domains
    ``[cluster.cross_domain]`` where given, else the domain figure. No domains declared: the node link."""
    domain = NODE_LINK
    if layout.cluster.domains:
        slow = min(layout.cluster.domains, key=lambda d: d.bandwidth_gbps)
        domain = (slow.latency_us * 1e-6, slow.bandwidth_gbps * 1e9 / 8)
    cross = layout.cluster.cross_domain
    across = (cross.latency_us * 1e-6, cross.bandwidth_gbps * 1e9 / 8) if cross.bandwidth_gbps > 0 else domain
    return {"local": (0.0, COPY_BANDWIDTH), "node": NODE_LINK, "domain": domain, "cross_domain": across}


def describe_bucket_step(layout, device: EmulatedDevice | None = None, step: int = 0) -> str:
    """``--dry-run``'s prediction of one hot-switching step (``simulate_buckets`` of step ``step``'s documents) on
    ``device`` (None: ``DRY_RUN_DEVICE``), links from ``link_costs``."""
    device = device or EmulatedDevice.parse(DRY_RUN_DEVICE)
    links = link_costs(layout)
    result = simulate_buckets(layout, step, device, links, copy_bandwidth=COPY_BANDWIDTH)
    tp = "" if math.isinf(device.tp_bandwidth) else f", TP links {device.tp_bandwidth * 8 / 1e9:g} Gbit/s"
    lines = [f"simulated step {step + 1} (its documents; devices of {device.flops / 1e9:g} GFLOP/s{tp}, node links "
             f"{links['node'][1] / 1e9:g} GB/s, {links['node'][0] * 1e6:g} us; HETERO_EMULATE_DEVICE sets the device):"]
    for i, seconds in enumerate(result.buckets):
        lines.append(f"  bucket {i}: " + ("no documents, skipped" if seconds is None else f"{seconds * 1e3:.3f} ms"))
    for a, b, seconds in result.switches:
        lines.append(f"  switch {a} -> {b}: {seconds * 1e3:.3f} ms")
    lines.append(f"  home gradient sync: {result.home_sync * 1e3:.3f} ms")
    switching = sum(x for _, _, x in result.switches)
    lines.append(f"  step: {result.total * 1e3:.3f} ms, switches {switching / result.total:.1%} of it"
                 if result.total else "  step: 0 ms")
    return "\n".join(lines)


def _home_sync_seconds(home, links: dict[str, tuple[float, float]]) -> float:
    """Ring all-reduce of each device's gradient shard across the home layout's pipelines (0 with one)."""
    replicas = len(home.layout.pipelines)
    if replicas < 2:
        return 0.0
    nodes = {r.device_id.partition(":")[0] for r in home.ranks}
    latency, bandwidth = links["node" if len(nodes) == 1 else "domain"]
    shard = max(sum(_numel(info.shape) // (info.shape[info.shard_dim or 0] or 1) * (hi - lo)
                    for info, lo, hi in home.params_of(r.rank)) for r in home.ranks) * FLOAT32_BYTES
    return 2 * (replicas - 1) / replicas * shard / bandwidth + 2 * (replicas - 1) * latency


def _numel(shape) -> int:
    return math.prod(shape)
