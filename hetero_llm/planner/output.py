"""From a candidate to a layout file (and to words): the TOML ``hetero-launch`` runs, the --explain table."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import attrs

from hetero_llm import layout as layout_mod
from hetero_llm._fs import write_atomically
from hetero_llm.errors import LayoutError
from hetero_llm.layout import BucketSpec, Layout, Optimizer, PipelineSpec, Recompute, Schedule, StageSpec
from hetero_llm.planner.buckets import Bucket, elastic_unit
from hetero_llm.planner.candidates import Candidate, PipelineChoice, Score, TPGroup
from hetero_llm.planner.cluster import Cluster
from hetero_llm.planner.cost import PlannerCostModel
from hetero_llm.planner.memory import ONE_IN_FLIGHT


def planned_layout(cluster: Cluster, cand: Candidate, buckets: Sequence[Bucket] = ()) -> Layout:
    """The layout of a plan: the cluster file's sections (its [plan] left out), the plan's schedule, its
    pipelines, and a ``[[buckets]]`` table per bucket when hot switching was planned (``bucket_specs``)."""
    default_rc = cluster.train.recompute is Recompute.FULL
    train = attrs.evolve(cluster.train, schedule=Schedule(cand.schedule), chunks=cand.chunks)
    if cand.optimizer:
        train = attrs.evolve(train, optimizer=Optimizer(cand.optimizer))
    return Layout(
        file=cluster.file,
        model=cluster.model,
        train=train,
        data=cluster.data,
        cluster=cluster.spec,
        pipelines=pipeline_specs(cand.pipelines, default_rc),
        buckets=bucket_specs(buckets, default_rc),
    )


def pipeline_specs(
    pipelines: Sequence[PipelineChoice], default_recompute: bool, unit: int = 1
) -> tuple[PipelineSpec, ...]:
    """A plan's pipelines as ``[[pipelines]]`` (batch and microbatches divided by ``unit``); a stage's recompute
    is written where it differs from train.recompute."""

    def recompute(on: bool) -> Recompute | None:
        return None if on == default_recompute else Recompute.FULL if on else Recompute.NONE

    return tuple(
        PipelineSpec(
            batch=p.batch // unit,
            microbatches=p.microbatches // unit,
            stages=tuple(
                StageSpec(
                    layers=st.layers, devices=tuple(st.group.devices), recompute=recompute(st.recompute), cp=st.group.cp
                )
                for st in p.stages
            ),
        )
        for p in pipelines
    )


def bucket_specs(buckets: Sequence[Bucket], default_recompute: bool) -> tuple[BucketSpec, ...]:
    """``[[buckets]]`` tables, shortest first (a bucket's pipeline ``batch`` is its share of the bucket's rows).
    Every bucket but the shortest tops up its rows with shorter documents; a planned bucket is elastic where
    ``elastic_unit`` allows, its shares cut to the smallest that keep the plan's proportions and rows per
    microbatch (a step then pads to a multiple of that, not of the global batch)."""
    out = []
    for i, b in enumerate(buckets):
        if b.plan is None:
            out.append(BucketSpec(max_len=b.max_len, top_up=i > 0))
            continue
        unit = elastic_unit(b.plan)
        out.append(
            BucketSpec(
                max_len=b.max_len,
                schedule=Schedule(b.plan.schedule),
                chunks=b.plan.chunks,
                pipelines=pipeline_specs(b.plan.pipelines, default_recompute, unit or 1),
                elastic=unit is not None,
                top_up=i > 0,
            )
        )
    return tuple(out)


def comments(cand: Candidate, score: Score, buckets: Sequence[Bucket] = ()) -> dict[str, str]:
    """What the written layout says beside its keys: each stage's device kind, domain and predicted memory;
    why each bucket has its layout."""
    out = {
        "train.schedule": "chosen by hetero-plan",
        **({"train.optimizer": "chosen by hetero-plan"} if cand.optimizer else {}),
        "pipelines[0]": f"planned pipelines: {summary(cand)}",
    }
    for p, pipe in enumerate(cand.pipelines):
        for s, st in enumerate(pipe.stages):
            out[f"pipelines[{p}].stages[{s}].devices"] = (
                f"{st.group.kind.name}, domain {st.group.domain}, {score.memory[p][s] / 1e9:.3g} GB per device"
            )
    for i, b in enumerate(buckets):
        if b.plan is None:
            why = b.why_home
        else:
            vs = f" (home layout: {b.why_home} s)" if b.why_home else ""
            assert b.score is not None  # a planned bucket is scored
            why = f"planned for rows of {b.max_len}: predicted step {b.score.step_time:.4g} s on full rows{vs}"
        out[f"buckets[{i}]"] = (
            "hot switching, a layout per document-length bucket (hetero-plan --buckets): " if i == 0 else ""
        ) + why
    return out


def cut_note(cluster: Cluster) -> str:
    """What the output says when the wall-clock cap, not the work budget, stopped the search."""
    return (
        f"the search was cut by the time cap (plan.time_budget_s = {cluster.limits.time_budget_s:g} s) before "
        "its work budget (plan.max_evals) was spent: this plan depends on the machine's speed and load (rerun "
        "on an idle machine, or raise plan.time_budget_s or lower plan.max_evals)"
    )


def header(cluster: Cluster, cand: Candidate, score: Score, seed: Score | None, cut_by_time: bool = False) -> str:
    peak = max(m for ms in score.memory for m in ms)
    lines = [
        f"# Planned by hetero-plan from {Path(cluster.file).name}: {summary(cand)}.",
        *([f"# NOTE: {cut_note(cluster)}."] if cut_by_time else []),
        "# PREDICTED by the planner's cost model (not measured):",
        f"#   step time {score.step_time:.4g} s, {score.tokens_per_s:.4g} tokens/s, MFU {score.mfu:.1%}, "
        f"bubble {score.bubble:.1%}, gradient sync {score.sync_time:.3g} s, optimizer {score.optimizer_time:.3g} s",
        f"#   compute lower bound {score.lower_bound:.4g} s (gap {score.gap:.1%}); peak memory {peak / 1e9:.3g} GB per device",
    ]
    for p, ms in enumerate(score.memory):
        lines.append(f"#   pipeline {p} peak GB per stage: " + " ".join(f"{m / 1e9:.3g}" for m in ms))
    if seed is not None and seed.feasible:
        lines.append(
            f"#   hetero-place's plan: {seed.step_time:.4g} s ({seed.step_time / score.step_time:.3f}x this one)"
        )
    lines.append("# Re-plan rather than edit the pipelines.")
    return "\n".join(lines) + "\n"


def summary(cand: Candidate) -> str:
    """'3 pipelines (2 of 9 stages, 1 of 4), zbh1': pipelines counted by their number of stages."""
    counts: dict[int, int] = {}
    for p in cand.pipelines:
        counts[len(p.stages)] = counts.get(len(p.stages), 0) + 1
    shapes = ", ".join(
        f"{n} of {k} stage{'s' if k > 1 else ''}" for k, n in sorted(counts.items(), key=lambda x: -x[1])
    )
    sched = cand.schedule + (f" x{cand.chunks} chunks" if cand.chunks > 1 else "")
    opt = f", {cand.optimizer}" if cand.optimizer else ""
    return f"{len(cand.pipelines)} pipeline{'s' if len(cand.pipelines) > 1 else ''} ({shapes}), {sched}{opt}"


def layout_text(
    cluster: Cluster,
    cand: Candidate,
    score: Score,
    seed: Score | None,
    buckets: Sequence[Bucket] = (),
    cut_by_time: bool = False,
) -> str:
    return layout_mod.dumps(
        planned_layout(cluster, cand, buckets),
        header=header(cluster, cand, score, seed, cut_by_time),
        comments=comments(cand, score, buckets),
    )


def check_out_path(cluster: Cluster, out_path: str | os.PathLike) -> None:
    """The layout can be written there (before the search): a data.path relative to the cluster file stays
    right only next to it."""
    src, out = Path(cluster.file), Path(out_path)
    if cluster.data.path and not Path(cluster.data.path).is_absolute() and src.resolve().parent != out.resolve().parent:
        raise LayoutError(
            cluster.file,
            "data.path",
            f"'{cluster.data.path}' is relative to the cluster file: write "
            "the layout next to it, or make data.path absolute",
        )


def write_layout(
    cluster: Cluster,
    out_path: str | os.PathLike,
    cand: Candidate,
    score: Score,
    seed: Score | None,
    buckets: Sequence[Bucket] = (),
    cut_by_time: bool = False,
) -> str:
    """Check the layout loads, then write it atomically."""
    src, out = Path(cluster.file), Path(out_path)
    check_out_path(cluster, out)
    text = layout_text(cluster, cand, score, seed, buckets, cut_by_time)
    layout_mod.loads(text, file=str(out_path), base_dir=src.parent)  # the result must be a valid layout
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, lambda f: f.write(text.encode("utf-8")))
    return text


def check_layout(
    cluster: Cluster, cand: Candidate, score: Score, seed: Score | None, buckets: Sequence[Bucket] = ()
) -> None:
    """The plan must be a valid layout (as ``write_layout`` checks before writing): for --explain or --json
    without -o."""
    text = layout_text(cluster, cand, score, seed, buckets)
    layout_mod.loads(text, file=cluster.file, base_dir=Path(cluster.file).parent)


def explain(cluster: Cluster, ranked, seed: Score | None) -> str:
    """The top plans side by side, and why the first wins."""
    cols = [
        ("step s", lambda c, s: f"{s.step_time:.4g}"),
        ("tokens/s", lambda c, s: f"{s.tokens_per_s:.4g}"),
        ("MFU", lambda c, s: f"{s.mfu:.1%}"),
        ("pipelines", lambda c, s: str(len(c.pipelines))),
        ("stages", lambda c, s: "/".join(str(len(p.stages)) for p in c.pipelines)),
        ("TP", lambda c, s: "/".join(sorted({str(st.group.tp) for p in c.pipelines for st in p.stages}))),
        ("schedule", lambda c, s: c.schedule + (f" x{c.chunks}" if c.chunks > 1 else "")),
        ("optimizer", lambda c, s: c.optimizer or "-"),
        ("rows/mb", lambda c, s: "/".join(sorted({str(p.rows) for p in c.pipelines}))),
        ("bubble", lambda c, s: f"{s.bubble:.1%}"),
        ("TP s", lambda c, s: f"{s.tp_time:.3g}"),
        ("sync s", lambda c, s: f"{s.sync_time:.3g}"),
        ("optim s", lambda c, s: f"{s.optimizer_time:.3g}"),
        ("peak GB", lambda c, s: f"{max(m for ms in s.memory for m in ms) / 1e9:.3g}"),
        ("recompute", lambda c, s: str(sum(st.recompute for p in c.pipelines for st in p.stages))),
    ]
    if any(st.group.cp > 1 for c, _ in ranked for p in c.pipelines for st in p.stages):
        cp = ("CP", lambda c, s: "/".join(sorted({str(st.group.cp) for p in c.pipelines for st in p.stages})))
        cols.insert(6, cp)
    rows = [[name] + [f(c, s) for c, s in ranked] for name, f in cols]
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    head = ["plan"] + [f"#{i + 1}" for i in range(len(ranked))]
    table = [" ".join(h.rjust(w) for h, w in zip(head, width))]
    table += [" ".join(v.rjust(w) for v, w in zip(r, width)) for r in rows]
    best_c, best = ranked[0]
    why = []
    for i, (_c, s) in enumerate(ranked[1:], 2):
        parts = []
        for what, a, b in (
            ("bubble time", s.bubble * max(s.pipeline_times), best.bubble * max(best.pipeline_times)),
            ("TP all-reduces", s.tp_time, best.tp_time),
            ("gradient sync", s.sync_time, best.sync_time),
            ("optimizer", s.optimizer_time, best.optimizer_time),
            ("slowest pipeline", max(s.pipeline_times), max(best.pipeline_times)),
        ):
            if a - b > 1e-3 * best.step_time:
                parts.append(f"{what} +{a - b:.3g} s")
        why.append(
            f"  #1 beats #{i} by {s.step_time / best.step_time - 1:.1%}: " + (", ".join(parts) or "within noise")
        )
    if seed is not None and seed.feasible:
        why.append(
            f"  hetero-place's plan predicts {seed.step_time:.4g} s: #1 is {seed.step_time / best.step_time:.3f}x faster"
        )
    return "\n".join(table + ["", "why #1 wins:"] + why)


def to_json(cand: Candidate, score: Score) -> dict:
    return {
        "schedule": cand.schedule,
        "chunks": cand.chunks,
        "optimizer": cand.optimizer or None,
        "pipelines": [
            {
                "batch": p.batch,
                "microbatches": p.microbatches,
                "stages": [
                    {
                        "layers": s.layers,
                        "devices": list(s.group.devices),
                        "kind": s.group.kind.name,
                        "recompute": s.recompute,
                        **({"cp": s.group.cp} if s.group.cp > 1 else {}),  # context parallelism: devices TP x CP
                    }
                    for s in p.stages
                ],
            }
            for p in cand.pipelines
        ],
        "predicted": {k: v for k, v in attrs.asdict(score).items() if k not in ("memory", "capacity")}
        | {"memory_gb": [[m / 1e9 for m in ms] for ms in score.memory], "gap": score.gap},
    }


def idle_devices(cluster: Cluster, cand: Candidate) -> list[tuple[str, str]]:
    """(device, reason) for each device of the cluster the plan leaves idle, in the cluster's order: too small
    for any stage (even one layer in the middle of a pipeline, one sequence per microbatch, recomputed, at
    the node's largest TP size and with no AdamW moments, so with ZeRO-1 too), or the plan is faster without it."""
    used = {d for p in cand.pipelines for s in p.stages for d in s.group.devices}
    cost = PlannerCostModel(cluster)
    ends = [(False, False)] if cluster.model.layers >= 3 else [(True, False), (False, True)]
    out = []
    for node in cluster.nodes:
        idle = [f"{node.name}:{i}" for i in range(node.devices) if f"{node.name}:{i}" not in used]
        if not idle:
            continue
        cap = cluster.limits.max_tp or node.devices
        tp = max(
            t
            for t in range(1, min(cap, node.devices) + 1)
            if cluster.model.heads % t == 0 and cluster.model.ffn_width % t == 0
        )
        group = TPGroup(node.name, node.domain, tuple(f"{node.name}:{i}" for i in range(tp)), node.kind)
        need = min(
            cost.stage_memory(group, 1, first, last, 1, True, ONE_IN_FLIGHT, moments=0.0 if cost.zero1 else None)
            for first, last in ends
        )
        have = cost.capacity(group)
        if need > have:
            why = (
                f"too small for any stage: one layer needs {need / 1e9:.3g} GB per device at TP {tp}, "
                f"a {node.kind.name} has {have / 1e9:.3g} GB (after plan.memory_margin)"
            )
        else:
            why = "left idle: the plan is predicted faster without it"
        out += [(d, why) for d in idle]
    return out


def idle_lines(idle: Sequence[tuple[str, str]]) -> list[str]:
    """The idle devices in words: one line per reason, each node's idle devices as runs ('g0:0-7')."""
    by_why: dict[str, dict[str, list[int]]] = {}
    for dev, why in idle:
        node, _, index = dev.rpartition(":")
        by_why.setdefault(why, {}).setdefault(node, []).append(int(index))
    lines = []
    for why, nodes in by_why.items():
        runs = []
        for node, ids in nodes.items():
            start = prev = ids[0]
            for i in [*ids[1:], None]:
                if i is not None and i == prev + 1:
                    prev = i
                    continue
                runs.append(f"{node}:{start}" + (f"-{prev}" if prev > start else ""))
                if i is not None:
                    start = prev = i
        count = sum(len(ids) for ids in nodes.values())
        lines.append(f"idle: {count} device{'s' if count > 1 else ''} ({', '.join(runs)}): {why}")
    return lines
