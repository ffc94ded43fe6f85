"""What ``--dry-run`` prints: the plan counted (``summary``: pipelines x stages, communicators by kind, buckets,
schedules; its length does not grow with the ranks), the whole plan (``describe``, ``--dry-run --full``: ranks,
network domains, communicators, gradient-sync buckets, schedule grids) or one rank's share of it
(``describe_rank``: what ``--dry-run --rank R`` shows). Torch-free.
"""

from __future__ import annotations

from collections import Counter

from hetero_llm import schedule as sched
from hetero_llm.layout import CROSS_DOMAIN, SHM
from hetero_llm.plan import Plan
from hetero_llm.plan.rank import RankPlan, StagePlan
from hetero_llm.schedule import Kind


def _ranges(st: StagePlan) -> str:
    return ",".join(f"{lo}-{hi - 1}" for lo, hi in st.chunk_ranges)


def _header(plan: Plan) -> str:
    lay = plan.layout
    return (
        f"layout {lay.file}: {plan.world_size} ranks, {len(lay.pipelines)} pipeline(s), "
        f"global batch {lay.train.global_batch}, schedule {lay.train.schedule.value}"
    )


def _spans(numbers: list[int]) -> str:
    """Sorted distinct integers as ranges: ``0-3,6,8-9``."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _between(values) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


FULL_HINT = "every rank, communicator, bucket and schedule grid: --dry-run --full; one rank: --dry-run --rank R"
SHAPES_SHOWN = 8  # pipeline shapes the summary lists before it counts the rest


def summary(plan: Plan) -> str:
    """The default ``--dry-run`` report: the plan counted (pipelines by shape, communicators by kind, buckets,
    schedules), a few dozen lines whatever the ranks; ``describe`` lists every rank, group and schedule grid."""
    lay = plan.layout
    per_node = Counter(r.node for r in plan.ranks)
    stages = Counter(len(p.stages) for p in lay.pipelines)
    lines = [
        _header(plan),
        "",
        f"nodes: {len(per_node)} with {_between(per_node.values())} rank{'s' if max(per_node.values()) > 1 else ''} each",
        "pipelines x stages: " + ", ".join(f"{n} x {s}" for s, n in sorted(stages.items())),
    ]
    shapes: dict[tuple, list[int]] = {}
    by_pipeline: dict[int, list[StagePlan]] = {}
    for st in plan.stages:
        by_pipeline.setdefault(st.pipeline, []).append(st)
    for pi, pipe in enumerate(lay.pipelines):
        sts = by_pipeline[pi]
        key = (tuple(st.tp for st in sts), tuple(_ranges(st) for st in sts), pipe.batch, pipe.microbatches)
        shapes.setdefault(key, []).append(pi)
    for (tps, ranges, batch, mb), pipes in list(shapes.items())[:SHAPES_SHOWN]:
        lines.append(
            f"  pipeline{'s' if len(pipes) > 1 else ''} {_spans(pipes)}: {len(tps)} stage{'s' if len(tps) > 1 else ''}, "
            f"tp {'/'.join(map(str, tps))}, layers {'/'.join(ranges)}, {batch} rows in {mb} mb"
            + (" each" if len(pipes) > 1 else "")
        )
    if len(shapes) > SHAPES_SHOWN:
        lines.append(f"  ... {len(shapes) - SHAPES_SHOWN} more pipeline shapes")
    domains = bool(lay.cluster.domains)
    if domains:
        lines += ["", *describe_domains(plan)]
    kinds: dict[str, list] = {}
    for g in (plan.world,) + plan.groups:
        kinds.setdefault(g.name.split("[", 1)[0], []).append(g)
    lines += ["", f"communicators (created in this order on every rank): {len(plan.groups) + 1}"]
    for kind, groups in kinds.items():
        via = ""
        if domains or any(g.transport == SHM for g in groups):
            counts = Counter(g.transport for g in groups)
            via = "  via " + ", ".join(f"{t} ({n})" if len(counts) > 1 else t for t, n in sorted(counts.items()))
        lines.append(f"  {kind:<10} {len(groups):>6}  of {_between([len(g.ranks) for g in groups])} ranks{via}")
    blocks = sum(len(b.entries) for b in plan.sync_blocks)
    lines.append(
        f"gradient sync buckets: {len(plan.sync_blocks)}, {blocks} blocks summed among exactly their holders"
        if plan.sync_blocks
        else "gradient sync buckets: none (a single pipeline holds every parameter once)"
    )
    # compile_plan gives pipelines with equal lists the same tuple: counted by identity, not by hashing every action
    grids = {id(s) for s in plan.schedules}
    lines += [
        f"schedules: {len(grids)} distinct grid{'s' if len(grids) > 1 else ''} over {len(plan.schedules)} "
        f"pipeline{'s' if len(plan.schedules) > 1 else ''}, {_between([len(a) for s in plan.schedules for a in s])} "
        "actions per rank"
    ]
    return "\n".join(lines)


def describe(plan: Plan) -> str:
    """The ``--dry-run --full`` report: rank table, communicators, per-pipeline schedule grids."""
    lay = plan.layout
    lines = [_header(plan), "", "rank  device      node      pipeline  stage  tp     layers   batch share"]
    for r in plan.ranks:
        st = plan.stage_of(r.rank)
        off, size = plan.batch_share(r.pipeline)
        lines.append(
            f"{r.rank:<5} {r.device_id:<11} {r.node:<9} {r.pipeline:<9} {r.stage:<6} "
            f"{r.tp_index}/{st.tp:<4} {_ranges(st):<8} "
            f"rows {off}-{off + size - 1} in {lay.pipelines[r.pipeline].microbatches} mb"
        )
    lines += describe_context(plan)
    domains = bool(lay.cluster.domains)
    if domains:
        lines += ["", *describe_domains(plan)]
    lines += ["", "communicators (created in this order on every rank):"]
    for g in ((plan.world,) if domains else ()) + plan.groups:
        via = f"  via {g.transport}" if domains or g.transport == SHM else ""
        lines.append(f"  {g.name:<28} ranks {list(g.ranks)}{via}")
    if not plan.groups:
        lines.append("  (none besides the world group)")
    lines += ["", "gradient sync buckets (blocks summed among exactly their holders):"]
    for b in plan.sync_blocks:
        layers = sorted({e[0].split(".")[1] if e[0].startswith("layers.") else e[0].split(".")[0] for e in b.entries})
        lines.append(f"  {b.name:<28} {len(b.entries)} blocks ({', '.join(layers)})")
    if not plan.sync_blocks:
        lines.append("  (none: a single pipeline holds every parameter once)")
    for pi, pipe_sched in enumerate(plan.schedules):
        lines += ["", f"pipeline {pi} schedule:", sched.format_grid([list(a) for a in pipe_sched])]
    return "\n".join(lines)


def describe_context(plan: Plan) -> list[str]:
    """The context-parallel groups of ``--dry-run`` (none without a stage of cp > 1): each group's ring and the
    positions of every sequence each of its ranks holds."""
    seq = plan.layout.model.seq_len
    cp_stages = [st for st in plan.stages if st.cp > 1]
    if not cp_stages:
        return []
    lines = ["", f"context parallelism (each rank holds two zigzag chunks of every row's {seq} positions):"]
    for st in cp_stages:
        for t in range(st.tp):
            ctx = plan.context(st.cp_ranks(t)[0])
            assert ctx is not None  # cp > 1 here
            held = "  ".join(f"rank {r}: {_chunks(plan.context(r))}" for r in ctx.ranks)
            off = "" if ctx.overlap else " (no overlap)"
            lines.append(
                f"  {ctx.group.name:<20} ring {' -> '.join(map(str, ctx.ranks))} -> {ctx.ranks[0]}{off}   {held}"
            )
    return lines


def _chunks(ctx) -> str:
    return ", ".join(f"{lo}-{hi - 1}" for lo, hi in ctx.chunks)


def describe_domains(plan: Plan) -> list[str]:
    """The network-domain table of ``--dry-run``: what each transport a group can get is set to."""
    c = plan.layout.cluster
    lines = [
        "network domains (a group uses its members' domain when they share one, else cross_domain):",
        f"  {'transport':<14} {'kind':<9} {'Gbit/s':>7} {'us':>6}  {'gloo if':<9} {'nodes':<20} nccl",
    ]

    def row(name: str, kind: str, spec, nodes: str) -> str:
        bw = f"{spec.bandwidth_gbps:g}" if spec.bandwidth_gbps else "?"
        lat = f"{spec.latency_us:g}" if spec.latency_us else "?"
        nccl = " ".join(f"{k}={v}" for k, v in spec.nccl) or "-"
        return f"  {name:<14} {kind:<9} {bw:>7} {lat:>6}  {spec.gloo_ifname or '(default)':<9} {nodes:<20} {nccl}"

    for d in c.domains:
        nodes = ",".join(n.name for n in c.nodes if n.domain == d.name) or "(none)"
        lines.append(row(d.name, d.kind.value, d, nodes))
    lines.append(row(CROSS_DOMAIN, "-", c.cross_domain, "(all)"))
    return lines


def describe_rank(rp: RankPlan) -> str:
    """What rank ``rp.rank`` will do, in the order it does it: where it runs, what it holds, whom it talks to."""
    st, info, b = rp.stage, rp.info, rp.batch
    layers = ",".join(f"{lo}-{hi - 1}" for lo, hi in st.chunk_ranges)
    c = rp.compute
    lines = [
        f"rank {rp.rank} of {rp.world_size} ({rp.file})",
        f"  device      {info.device_id} on node {info.node} ({info.device})",
        f"  stage       pipeline {st.pipeline} stage {st.stage} of {st.num_stages}, layers {layers}"
        f" ({len(st.chunk_ranges)} chunk{'s' if len(st.chunk_ranges) > 1 else ''})",
        f"  tp          index {info.tp_index} of {st.tp}, ranks {list(st.tp_ranks(info.cp_index))}"
        + (f", group {rp.tp_group.name}" if rp.tp_group else ""),
        *(
            [
                f"  cp          index {rp.context.index} of {rp.context.size}, ring {list(rp.context.ranks)} "
                f"in {rp.context.group.name}: keys/values to rank {rp.context.send_to}, from rank "
                f"{rp.context.recv_from}; holds positions {_chunks(rp.context)} of every row"
            ]
            if rp.context
            else []
        ),
        f"  batch share rows {b.offset}-{b.offset + b.size - 1} of {rp.train.global_batch}"
        f" in {b.microbatches} microbatch{'es' if b.microbatches > 1 else ''}",
        f"  compute     precision {c.precision.value}, recompute {'full' if c.recompute else 'none'}, "
        f"compile {'blocks' if c.compile else 'none'}",
        f"  schedule    {'dynamic (1F1B order as priorities)' if rp.dynamic else rp.train.schedule.value}"
        f"{', split backward' if rp.split_backward else ''}"
        f"{', sharded optimizer (adamw_zero1)' if rp.sharded_optimizer else ''}",
        f"  loss        {'counted here (last stage, TP rank 0)' if rp.counts_loss else 'not counted here'}; "
        f"{'reports progress and metrics' if rp.reports else 'reports nothing'}",
        "",
        f"actions ({len(rp.actions)}, in order):",
        "  " + " ".join(map(str, rp.actions)),
    ]
    lines += ["", "routes (stage-boundary pieces):"]
    r = rp.routes
    sides = [
        (Kind.RECV_F, [r.recv_f] if r.recv_f else list(r.recv_f_runs)),
        (Kind.SEND_F, list(r.send_f)),
        (Kind.RECV_B, [r.recv_b] if r.recv_b else list(r.recv_b_runs)),
        (Kind.SEND_B, list(r.send_b)),
    ]
    for kind, routes in sides:
        for route in routes:
            key = r.group(kind)
            assert key is not None  # a side with a route has its group
            what = (
                "positions " + ", ".join(f"{s}-{s + n - 1} -> {d}-{d + n - 1}" for s, d, n in route.runs)
                if route.runs
                else f"piece {route.piece} of {route.pieces}"
            )
            lines.append(f"  {kind.value.lower():<7} {what}  rank {route.src} -> rank {route.dst}  in {key.name}")
    if not any(routes for _, routes in sides):
        lines.append("  (none: a one-stage pipeline)")
    lines += ["", "groups this rank creates, in order (* = a member):"]
    for g in (rp.world,) + rp.groups:
        env = rp.network.env(g.key)
        settings = " ".join(f"{k}={v}" for k, v in sorted(env.items()))
        lines.append(
            f"  {'*' if rp.rank in g.ranks else ' '} {g.name:<28} ranks {list(g.ranks)}  via {g.transport}"
            + (f"  {settings}" if settings else "")
        )
    lines += ["", f"parameter shards ({len(rp.shards)}):"]
    for s in rp.shards:
        dim = s.info.shard_dim
        where = "replicated" if dim is None else f"dim {dim}: {s.lo}-{s.hi - 1} of {s.info.shape[dim]}"
        lines.append(f"  {s.name:<28} {list(s.info.shape)}  {where}")
    lines += ["", "gradient sync buckets:"]
    for bucket in rp.sync_blocks:
        lines.append(f"  {bucket.name:<28} {len(bucket.entries)} blocks")
    if not rp.sync_blocks:
        lines.append("  (none: no other pipeline holds a shard of this rank's)")
    return "\n".join(lines)
