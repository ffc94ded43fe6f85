"""Bucket layouts for hot switching (``hetero-plan --buckets 128,512``): a layout per document-length bucket.

The home layout is the planner's plan for the whole ``model.seq_len`` (it must hold the longest
documents and takes the optimizer step). For every shorter bound, the same search runs on the cluster
with ``seq_len`` set to that bound: rows of that width, so the activations (memory, against each device
kind's ``memory_gb``) and the compute (attention included) are the bucket's; its plan becomes the
bucket's ``[[buckets.pipelines]]``, schedule and chunks. A bucket whose plan equals the home layout, or
uses a device the home layout leaves idle (a bucket runs on the home layout's processes), runs under
the home layout instead. Torch-free, like the planner.
"""

from __future__ import annotations

import math

import os
from pathlib import Path

import attrs

from hetero_llm import layout as layout_mod
from hetero_llm._fs import write_atomically
from hetero_llm.errors import LayoutError
from hetero_llm.layout import Recompute
from hetero_llm.planner.cluster import Cluster
from hetero_llm.planner.cost import Candidate, Score


@attrs.frozen
class Bucket:
    max_len: int
    plan: Candidate | None  # None: the home layout
    score: Score | None
    why_home: str = ""  # why a bucket runs under the home layout (with a plan: home's predicted step s, if known)


def parse_bounds(text: str, cluster: Cluster) -> tuple[int, ...]:
    """``--buckets 128,512``: ascending positive bounds below ``model.seq_len`` (which is added as the last
    bucket, the home layout's). One-line errors naming the option."""
    seq_len = cluster.model.seq_len
    if cluster.data.packing.value != "documents":
        raise LayoutError(cluster.file, "data.packing", "--buckets sorts whole documents by length: set "
                          'data.packing = "documents" in the cluster file')
    try:
        bounds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LayoutError(cluster.file, "--buckets", f"'{text}' is not a comma-separated list of whole numbers "
                          "(e.g. --buckets 128,512)") from None
    if not bounds:
        raise LayoutError(cluster.file, "--buckets", "is empty: give the bucket bounds, e.g. --buckets 128,512")
    if bounds[-1] == seq_len:
        bounds.pop()  # the home layout's bucket, given explicitly
    for a, b in zip(bounds, bounds[1:]):
        if b <= a:
            raise LayoutError(cluster.file, "--buckets", f"bounds must ascend strictly, got {a} then {b}")
    for b in bounds:
        if not 1 <= b < seq_len:
            raise LayoutError(cluster.file, "--buckets", f"bound {b} is outside 1..{seq_len - 1} (the last bucket is "
                              f"model.seq_len = {seq_len}, the home layout's)")
    return tuple(bounds) + (seq_len,)


MIN_GAIN = 1.05  # a bucket's own layout must be predicted this much faster than home's on its rows: the search
# does not price the two switches it costs (the simulator does: hetero-launch --dry-run)


def propose(cluster: Cluster, bounds: tuple[int, ...], home: Candidate) -> list[Bucket]:
    """A plan per bucket bound (the last, ``model.seq_len``, is the home layout)."""
    from hetero_llm.planner import plan_cluster
    from hetero_llm.planner.search import Planner

    home_devices = {d for p in home.pipelines for s in p.stages for d in s.group.devices}
    out = []
    for bound in bounds[:-1]:
        shorter = attrs.evolve(cluster, model=attrs.evolve(cluster.model, seq_len=bound))
        result = plan_cluster(shorter, top=1)
        cand, score = result.best, result.score
        at_home = Planner(shorter).evaluate(home)  # the home layout on this bucket's rows
        devices = [d for p in cand.pipelines for s in p.stages for d in s.group.devices]
        if not set(devices) <= home_devices:
            out.append(Bucket(bound, None, None, "its plan uses devices the home layout leaves idle"))
        elif cand == home or (at_home is not None and at_home.feasible
                              and score.step_time * MIN_GAIN > at_home.step_time):
            home_s = f"{at_home.step_time:.4g}" if at_home is not None else "?"
            out.append(Bucket(bound, None, None, f"home layout: its own plan ({score.step_time:.4g} s) is not "
                              f"{MIN_GAIN:g}x faster than home's on its rows ({home_s} s)"))
        else:
            out.append(Bucket(bound, cand, score, "" if at_home is None else f"{at_home.step_time:.4g}"))
    return out + [Bucket(bounds[-1], None, None, "the longest documents: the home layout")]


def elastic_unit(plan: Candidate) -> int | None:
    """The factor an elastic bucket divides the plan's pipeline batches and microbatches by (their microbatches'
    greatest common divisor), or None where an elastic bucket could hold more activations than the plan was
    checked for: only 1F1B and ZB-H1 bound what a stage holds by the stage count whatever the microbatches,
    and only once every pipeline has at least as many microbatches as stages (as planned)."""
    if plan.schedule not in ("1f1b", "zbh1") or any(p.microbatches < len(p.stages) for p in plan.pipelines):
        return None
    return math.gcd(*(p.microbatches for p in plan.pipelines))


def buckets_toml(buckets: list[Bucket], default_recompute: bool) -> str:
    """``[[buckets]]`` tables, shortest first (a bucket's pipeline ``batch`` is its share of the bucket's rows).
    Every bucket but the shortest tops up its rows with shorter documents; a planned bucket is elastic where
    ``elastic_unit`` allows, its shares cut to the smallest that keep the plan's proportions and rows per
    microbatch (a step then pads to a multiple of that, not of the global batch)."""
    lines = ["# ---- hot switching: a layout per document-length bucket (hetero-plan --buckets) ----"]
    for i, b in enumerate(buckets):
        top_up = ["top_up = true"] if i else []
        if b.plan is None:
            lines += [f"[[buckets]]                    # {b.why_home}", f"max_len = {b.max_len}", *top_up, ""]
            continue
        vs = f" (home layout: {b.why_home} s)" if b.why_home else ""
        unit = elastic_unit(b.plan)
        lines += [f"[[buckets]]                    # planned for rows of {b.max_len}: predicted step "
                  f"{b.score.step_time:.4g} s on full rows{vs}",
                  f"max_len = {b.max_len}", f'schedule = "{b.plan.schedule}"', f"chunks = {b.plan.chunks}",
                  f"elastic = {'true' if unit else 'false'}", *top_up]
        for pipe in b.plan.pipelines:
            lines += ["[[buckets.pipelines]]", f"batch = {pipe.batch // (unit or 1)}",
                      f"microbatches = {pipe.microbatches // (unit or 1)}"]
            for st in pipe.stages:
                devs = ", ".join(f'"{d}"' for d in st.group.devices)
                lines += ["[[buckets.pipelines.stages]]", f"layers = {st.layers}", f"devices = [{devs}]"]
                if st.recompute != default_recompute:
                    lines.append(f'recompute = "{"full" if st.recompute else "none"}"')
        lines.append("")
    return "\n".join(lines)


def add_buckets(cluster: Cluster, out_path: str | os.PathLike, home: Candidate,
                bounds: tuple[int, ...]) -> list[Bucket]:
    """Append the proposed ``[[buckets]]`` to the layout ``hetero-plan`` wrote at ``out_path``, check the
    result loads as a layout, and write it atomically."""
    buckets = propose(cluster, bounds, home)
    out = Path(out_path)
    text = out.read_text().rstrip("\n") + "\n\n" + buckets_toml(buckets, cluster.train.recompute is Recompute.FULL)
    layout_mod.loads(text, file=str(out_path), base_dir=Path(cluster.file).parent)  # must be a valid layout
    write_atomically(out, lambda f: f.write(text.encode()))
    return buckets
