"""Simulated hot-switching steps and emulated devices (docs/hot_switching.md).

A bucketed step on a modelled device (predict/device.py):
each bucket's pipelines on their own schedules (``simulate.simulate``), the switches between layouts
priced per link kind (``switch_seconds``), and the home layout's gradient sync (``simulate_buckets``).
Torch-free.
"""

from __future__ import annotations

import math

import attrs

from hetero_llm.model import cp_chunks
from hetero_llm.predict.device import FLOAT32_BYTES, EmulatedDevice, action_seconds
from hetero_llm.predict.simulate import CostModel, simulate

__all__ = ["BucketStep", "describe_bucket_step", "link_costs", "simulate_buckets", "switch_seconds"]

# --------------------------------------------------------------------------------------------------


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
        lines = [
            f"predicted step {self.total * 1e3:.1f} ms: buckets "
            + ", ".join("-" if b is None else f"{b * 1e3:.1f}" for b in self.buckets)
            + " ms, switches "
            + ", ".join(f"{a}->{b} {s * 1e3:.2f}" for a, b, s in self.switches)
            + " ms, home gradient sync "
            + f"{self.home_sync * 1e3:.2f} ms"
        ]
        return "\n".join(lines)


def switch_seconds(
    plan,
    links: dict[str, tuple[float, float]],
    copy_bandwidth: float = math.inf,
    block_overhead: float = 0.0,
    buffer_overhead: float = 0.0,
) -> float:
    """Seconds of one batched switch (``switch.SwitchPlan``): every device at once, each paying, per
    device-pair message it sends or receives, the latency of that pair's link (``links``: link kind ->
    (latency s, bytes/s), kinds as ``switch.LINKS``), the larger of its sent and received bytes over each
    link kind (a device's sends and receives overlap), one pass over each block it copies (local), packs
    (sender) or unpacks (receiver) at ``copy_bandwidth``, ``block_overhead`` per transfer it takes part in, and
    ``buffer_overhead`` per gradient buffer it allocates (``plan.grad_buffers``). The slowest device is the
    switch's time."""
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
        for device in {t.src, t.dst}:  # local: one copy; network: packed by the sender, unpacked by the receiver
            per_device[device] = per_device.get(device, 0.0) + t.nbytes / copy_bandwidth + block_overhead
    for device, buffers in plan.grad_buffers.items():
        per_device[device] = per_device.get(device, 0.0) + buffers * buffer_overhead
    return max(per_device.values(), default=0.0)


def _pipeline_seconds(
    plan, pipeline: int, pieces: list, device: EmulatedDevice, links: dict[str, tuple[float, float]]
) -> float:
    """One pipeline of ``plan`` over its microbatches ``pieces`` (``documents.PackedRows``), simulated."""
    stages = sorted((s for s in plan.stages if s.pipeline == pipeline), key=lambda s: s.stage)
    model = plan.layout.model
    forward, backward, weight = [], [], []
    for st in stages:
        chunks = len(st.chunk_ranges)
        recompute = plan.rank_plan(st.ranks[0]).compute.recompute
        per = {k: 0.0 for k in "FBW"}
        for piece in pieces:
            rows, width = piece.inputs.shape
            if st.cp > 1:  # a CP rank's columns, and the slowest CP rank's share of the rows' attention
                square = max(cp_chunks.attention_shares(piece.spans, rows, width, st.cp))
                width //= st.cp
            else:
                square = int((piece.spans[:, 2].astype("int64") ** 2).sum())
            for c in range(chunks):
                lo, hi, _, head = st.chunk_shape(c)
                for k in per:
                    per[k] += action_seconds(model, k, hi - lo, rows, width, square, st.tp, head, device, recompute)
        forward.append(per["F"] / len(pieces))
        backward.append(per["B"] / len(pieces))
        weight.append(min(per["W"], per["B"]) / len(pieces))
    rows, width = pieces[0].inputs.shape
    node_of = [plan.ranks[s.ranks[0]].device_id.partition(":")[0] for s in stages]
    kinds = ["node" if a == b else "domain" for a, b in zip(node_of, node_of[1:] + node_of[:1])]
    if len(stages) == 1:
        kinds = ["node"]
    cost = CostModel(
        forward=forward,
        backward=backward,
        weight=weight,
        latency=[links[k][0] for k in kinds],
        bandwidth=[links[k][1] for k in kinds],
        activation_bytes=rows * width * model.hidden * FLOAT32_BYTES,
    )
    schedule = [plan.actions(s.ranks[0]) for s in stages]
    return simulate(schedule, cost).step_time


def simulate_buckets(
    layout,
    step: int,
    device: EmulatedDevice,
    links: dict[str, tuple[float, float]],
    *,
    copy_bandwidth: float = math.inf,
    block_overhead: float = 0.0,
    buffer_overhead: float = 0.0,
    source=None,
) -> BucketStep:
    """Predict one hot-switching step of a layout with ``[[buckets]]``: the step's documents (the ones
    ``switcher`` trains on: ``documents.fill_documents`` of (seed, step)) sorted into buckets and packed
    as the runtime packs them; each bucket with documents simulated under its layout (``simulate`` per
    pipeline, with ``action_seconds`` on ``device``; the slowest pipeline is the bucket's time); the
    switches the step makes (``switch.step_switch``, priced by ``switch_seconds``); the home layout's
    gradient all-reduce across its pipelines (ring, over the slowest link among them). Torch-free."""
    from hetero_llm.data import documents, sources
    from hetero_llm.plan import compile_plan
    from hetero_llm.switching import bucketing

    home = compile_plan(layout)
    plans = list(home.buckets)
    if source is None:
        source = sources.document_sources(layout.data, layout.model.seq_len, layout.file)[0]  # training's
    docs = documents.fill_documents(source, layout.train.seed, step, layout.train.global_batch, layout.model.seq_len)
    rows_of = bucketing.bucket_rows(layout, docs)
    times: list[float | None] = []
    for i, (plan, rows) in enumerate(zip(plans, rows_of)):
        if rows is None:
            times.append(None)
            continue
        elastic = layout.buckets[i].elastic
        rounds, split = bucketing.bucket_split(plan.layout.pipelines, rows.num_rows, elastic)
        runs = plan.for_rounds(rounds) if elastic else plan
        times.append(
            max(_pipeline_seconds(runs, j, rows.share(*share), device, links) for j, share in enumerate(split))
        )
    switches = step_switches(layout, home, plans, rows_of, links, copy_bandwidth, block_overhead, buffer_overhead)
    return BucketStep(tuple(times), tuple(switches), _home_sync_seconds(home, links))


def step_switch_plans(layout, home, plans: list, rows_of: list) -> list[tuple[str, str, object]]:
    """The switches a step makes, (from, to, ``switch.SwitchPlan``), as the run makes them (``switch.step_switch``):
    shortest bucket with rows (``rows_of``, ``bucketing.bucket_rows``; None: skipped) first, none between equal
    layouts, parameters from home, gradients from the layout before, back to home after the last bucket."""
    from hetero_llm.switching.transfers import step_switch

    switches: list[tuple[str, str, object]] = []
    current, current_name, accumulated = home, "home", False
    for i, (plan, rows) in enumerate(zip(plans, rows_of)):
        if rows is None:
            continue
        name = "home" if not layout.buckets[i].pipelines else f"b{i}"
        if plan.layout.pipelines != current.layout.pipelines:
            sw = step_switch(home, current, plan, params=bool(layout.buckets[i].pipelines), grads=accumulated)
            switches.append((current_name, name, sw))
        current, current_name, accumulated = plan, name, True
    if current.layout.pipelines != home.layout.pipelines:
        switches.append((current_name, "home", step_switch(home, current, home, params=False, grads=accumulated)))
    return switches


def step_switches(
    layout,
    home,
    plans: list,
    rows_of: list,
    links: dict[str, tuple[float, float]],
    copy_bandwidth: float = math.inf,
    block_overhead: float = 0.0,
    buffer_overhead: float = 0.0,
) -> list[tuple[str, str, float]]:
    """``step_switch_plans`` priced: (from, to, ``switch_seconds``)."""
    costs = (copy_bandwidth, block_overhead, buffer_overhead)
    return [(a, b, switch_seconds(sw, links, *costs)) for a, b, sw in step_switch_plans(layout, home, plans, rows_of)]


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
    lines = [
        f"simulated step {step + 1} (its documents; devices of {device.flops / 1e9:g} GFLOP/s{tp}, node links "
        f"{links['node'][1] / 1e9:g} GB/s, {links['node'][0] * 1e6:g} us; HETERO_EMULATE_DEVICE sets the device):"
    ]
    for i, seconds in enumerate(result.buckets):
        lines.append(f"  bucket {i}: " + ("no documents, skipped" if seconds is None else f"{seconds * 1e3:.3f} ms"))
    for a, b, seconds in result.switches:
        lines.append(f"  switch {a} -> {b}: {seconds * 1e3:.3f} ms")
    lines.append(f"  home gradient sync: {result.home_sync * 1e3:.3f} ms")
    switching = sum(x for _, _, x in result.switches)
    lines.append(
        f"  step: {result.total * 1e3:.3f} ms, switches {switching / result.total:.1%} of it"
        if result.total
        else "  step: 0 ms"
    )
    return "\n".join(lines)


def _home_sync_seconds(home, links: dict[str, tuple[float, float]]) -> float:
    """Ring all-reduce of each device's gradient shard across the home layout's pipelines (0 with one)."""
    replicas = len(home.layout.pipelines)
    if replicas < 2:
        return 0.0
    nodes = {r.device_id.partition(":")[0] for r in home.ranks}
    latency, bandwidth = links["node" if len(nodes) == 1 else "domain"]
    shard = (
        max(
            sum(
                _numel(info.shape) // (info.shape[info.shard_dim or 0] or 1) * (hi - lo)
                for info, lo, hi in home.params_of(r.rank)
            )
            for r in home.ranks
        )
        * FLOAT32_BYTES
    )
    return 2 * (replicas - 1) / replicas * shard / bandwidth + 2 * (replicas - 1) * latency


def _numel(shape) -> int:
    return math.prod(shape)
