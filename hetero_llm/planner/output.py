"""From a candidate to a layout file (and to words): the TOML ``hetero-launch`` runs, the --explain table."""

from __future__ import annotations

import os
import re
from pathlib import Path

import attrs

from hetero_llm import layout as layout_mod
from hetero_llm._fs import write_atomically
from hetero_llm.errors import LayoutError
from hetero_llm.layout import Recompute, Schedule
from hetero_llm.planner.cluster import Cluster
from hetero_llm.planner.cost import Candidate, Score
from hetero_llm.planner.place import Placement


def from_placement(cluster: Cluster, placement: Placement) -> Candidate:
    """hetero-place's plan as a candidate (the search's seed)."""
    from hetero_llm.planner.cost import Group, PipelineChoice, StageChoice

    pipes = []
    for p in placement.pipelines:
        stages = tuple(StageChoice(Group(s.unit.node, s.unit.domain, s.unit.devices, cluster.node(s.unit.node).kind),
                                   s.layers, cluster.train.recompute is Recompute.FULL) for s in p.stages)
        pipes.append(PipelineChoice(p.batch, p.microbatches, stages))
    t = cluster.train
    schedule = t.schedule.value if t.schedule in (Schedule.ONE_F_ONE_B, Schedule.ZBH1, Schedule.INTERLEAVED) else "1f1b"
    return Candidate(tuple(pipes), schedule, t.chunks if schedule == "interleaved" else 1)


def pipelines_toml(cluster: Cluster, cand: Candidate, score: Score) -> str:
    default_rc = cluster.train.recompute is Recompute.FULL
    lines = []
    for p, pipe in enumerate(cand.pipelines):
        lines += ["[[pipelines]]", f"batch = {pipe.batch}", f"microbatches = {pipe.microbatches}"]
        for s, st in enumerate(pipe.stages):
            devs = ", ".join(f'"{d}"' for d in st.group.devices)
            gb = score.memory[p][s] / 1e9
            lines += ["[[pipelines.stages]]", f"layers = {st.layers}",
                      f"devices = [{devs}]  # {st.group.kind.name}, domain {st.group.domain}, {gb:.3g} GB per device"]
            if st.recompute != default_rc:
                lines.append(f'recompute = "{"full" if st.recompute else "none"}"')
        lines.append("")
    return "\n".join(lines)


def header(cluster: Cluster, cand: Candidate, score: Score, seed: Score | None) -> str:
    peak = max(m for ms in score.memory for m in ms)
    lines = [
        f"# Planned by hetero-plan from {Path(cluster.file).name}: {summary(cand)}.",
        "# PREDICTED by the planner's cost model (not measured):",
        f"#   step time {score.step_time:.4g} s, {score.tokens_per_s:.4g} tokens/s, MFU {score.mfu:.1%}, "
        f"bubble {score.bubble:.1%}, gradient sync {score.sync_time:.3g} s, optimizer {score.optimizer_time:.3g} s",
        f"#   compute lower bound {score.lower_bound:.4g} s (gap {score.gap:.1%}); peak memory {peak / 1e9:.3g} GB per device",
    ]
    for p, ms in enumerate(score.memory):
        lines.append(f"#   pipeline {p} peak GB per stage: " + " ".join(f"{m / 1e9:.3g}" for m in ms))
    if seed is not None and seed.feasible:
        lines.append(f"#   hetero-place's plan: {seed.step_time:.4g} s ({seed.step_time / score.step_time:.3f}x this one)")
    lines.append("# Re-plan rather than edit the pipelines.")
    return "\n".join(lines) + "\n"


def summary(cand: Candidate) -> str:
    """'3 pipelines (2 of 9 stages, 1 of 4), zbh1': pipelines counted by their number of stages."""
    counts: dict[int, int] = {}
    for p in cand.pipelines:
        counts[len(p.stages)] = counts.get(len(p.stages), 0) + 1
    shapes = ", ".join(f"{n} of {k} stage{'s' if k > 1 else ''}" for k, n in sorted(counts.items(), key=lambda x: -x[1]))
    sched = cand.schedule + (f" x{cand.chunks} chunks" if cand.chunks > 1 else "")
    return f"{len(cand.pipelines)} pipeline{'s' if len(cand.pipelines) > 1 else ''} ({shapes}), {sched}"


_HEADER = re.compile(r"\s*\[\[?\s*([A-Za-z0-9_\-\".]+)\s*\]\]?\s*(#.*)?")


def set_train_schedule(text: str, schedule: str, chunks: int) -> str:
    """The [train] table with its schedule and chunks replaced (the layout runs one schedule everywhere)."""
    out, section, done = [], None, False
    for line in text.splitlines():
        m = _HEADER.fullmatch(line)
        if m:
            section = m.group(1)
        if section == "train" and re.match(r"\s*(schedule|chunks)\s*=", line):
            continue
        out.append(line)
        if m and section == "train" and not done:
            out += [f'schedule = "{schedule}"  # chosen by hetero-plan', f"chunks = {chunks}"]
            done = True
    return "\n".join(out) + "\n"


def layout_text(cluster: Cluster, cand: Candidate, score: Score, seed: Score | None) -> str:
    lines = cluster.text.splitlines()
    while lines and lines[0].startswith("#"):  # the cluster file's preamble describes that file
        lines.pop(0)
    body = set_train_schedule("\n".join(lines), cand.schedule, cand.chunks)
    return (header(cluster, cand, score, seed) + body.rstrip("\n") + f"\n\n# ---- planned pipelines: {summary(cand)} ----\n"
            + pipelines_toml(cluster, cand, score))


def write_layout(cluster: Cluster, out_path: str | os.PathLike, cand: Candidate, score: Score,
                 seed: Score | None) -> str:
    """Check the layout loads, then write it atomically."""
    src, out = Path(cluster.file), Path(out_path)
    if cluster.data.path and not Path(cluster.data.path).is_absolute() and src.resolve().parent != out.resolve().parent:
        raise LayoutError(cluster.file, "data.path", f"'{cluster.data.path}' is relative to the cluster file: write "
                          "the layout next to it, or make data.path absolute")
    text = layout_text(cluster, cand, score, seed)
    layout_mod.loads(text, file=str(out_path), base_dir=src.parent)  # the result must be a valid layout
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, lambda f: f.write(text.encode()))
    return text


def explain(cluster: Cluster, ranked, seed: Score | None) -> str:
    """The top plans side by side, and why the first wins."""
    cols = [("step s", lambda c, s: f"{s.step_time:.4g}"), ("tokens/s", lambda c, s: f"{s.tokens_per_s:.4g}"),
            ("MFU", lambda c, s: f"{s.mfu:.1%}"), ("pipelines", lambda c, s: str(len(c.pipelines))),
            ("stages", lambda c, s: "/".join(str(len(p.stages)) for p in c.pipelines)),
            ("TP", lambda c, s: "/".join(sorted({str(st.group.tp) for p in c.pipelines for st in p.stages}))),
            ("schedule", lambda c, s: c.schedule), ("rows/mb", lambda c, s: "/".join(sorted({str(p.rows) for p in c.pipelines}))),
            ("bubble", lambda c, s: f"{s.bubble:.1%}"), ("TP s", lambda c, s: f"{s.tp_time:.3g}"),
            ("sync s", lambda c, s: f"{s.sync_time:.3g}"), ("optim s", lambda c, s: f"{s.optimizer_time:.3g}"),
            ("peak GB", lambda c, s: f"{max(m for ms in s.memory for m in ms) / 1e9:.3g}"),
            ("recompute", lambda c, s: str(sum(st.recompute for p in c.pipelines for st in p.stages)))]
    rows = [[name] + [f(c, s) for c, s in ranked] for name, f in cols]
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    head = ["plan"] + [f"#{i + 1}" for i in range(len(ranked))]
    table = [" ".join(h.rjust(w) for h, w in zip(head, width))]
    table += [" ".join(v.rjust(w) for v, w in zip(r, width)) for r in rows]
    best_c, best = ranked[0]
    why = []
    for i, (c, s) in enumerate(ranked[1:], 2):
        parts = []
        for what, a, b in (("bubble time", s.bubble * max(s.pipeline_times), best.bubble * max(best.pipeline_times)),
                           ("TP all-reduces", s.tp_time, best.tp_time), ("gradient sync", s.sync_time, best.sync_time),
                           ("optimizer", s.optimizer_time, best.optimizer_time),
                           ("slowest pipeline", max(s.pipeline_times), max(best.pipeline_times))):
            if a - b > 1e-3 * best.step_time:
                parts.append(f"{what} +{a - b:.3g} s")
        why.append(f"  #1 beats #{i} by {s.step_time / best.step_time - 1:.1%}: " + (", ".join(parts) or "within noise"))
    if seed is not None and seed.feasible:
        why.append(f"  hetero-place's plan predicts {seed.step_time:.4g} s: #1 is {seed.step_time / best.step_time:.3f}x faster")
    return "\n".join(table + ["", "why #1 wins:"] + why)


def to_json(cand: Candidate, score: Score) -> dict:
    return {
        "schedule": cand.schedule, "chunks": cand.chunks,
        "pipelines": [{"batch": p.batch, "microbatches": p.microbatches,
                       "stages": [{"layers": s.layers, "devices": list(s.group.devices), "kind": s.group.kind.name,
                                   "recompute": s.recompute} for s in p.stages]} for p in cand.pipelines],
        "predicted": {k: v for k, v in attrs.asdict(score).items() if k not in ("memory", "capacity")}
        | {"memory_gb": [[m / 1e9 for m in ms] for ms in score.memory], "gap": score.gap},
    }
