"""Bucket layouts for hot switching (``hetero-plan --buckets 128,512``): a layout per document-length bucket.

The home layout is the planner's plan for the whole ``model.seq_len`` (it must hold the longest
documents and takes the optimizer step). For every shorter bound, the same search runs on the cluster
with ``seq_len`` set to that bound: rows of that width, so the activations (memory, against each device
kind's ``memory_gb``) and the compute (attention included) are the bucket's; its plan becomes the
bucket's ``[[buckets.pipelines]]``, schedule and chunks. A bucket whose plan equals the home layout, or
uses a device the home layout leaves idle (a bucket runs on the home layout's processes), runs under
the home layout instead. ``switching.worth.judge`` then prices whole steps with these buckets (their switches and
the memory of their shard copies) against the best static plan, and keeps them only where that pays: the two
are hot switching's decisions, in this package. Torch-free, like the planner.
"""

from __future__ import annotations

import attrs

from hetero_llm.errors import LayoutError
from hetero_llm.planner import plan_cluster
from hetero_llm.planner.buckets import Bucket
from hetero_llm.planner.candidates import Candidate
from hetero_llm.planner.cluster import Cluster
from hetero_llm.planner.search import Planner


def parse_bounds(text: str, cluster: Cluster) -> tuple[int, ...]:
    """``--buckets 128,512``: ascending positive bounds below ``model.seq_len`` (which is added as the last
    bucket, the home layout's). One-line errors naming the option."""
    seq_len = cluster.model.seq_len
    if cluster.data.packing.value != "documents":
        raise LayoutError(
            cluster.file,
            "data.packing",
            '--buckets sorts whole documents by length: set data.packing = "documents" in the cluster file',
        )
    if cluster.limits.max_cp > 1:
        raise LayoutError(
            cluster.file,
            "plan.max_cp",
            f"{cluster.limits.max_cp}: hot switching (--buckets) does not support context parallelism yet (plan "
            "with plan.max_cp = 1, or without --buckets)",
        )
    try:
        bounds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LayoutError(
            cluster.file,
            "--buckets",
            f"'{text}' is not a comma-separated list of whole numbers (e.g. --buckets 128,512)",
        ) from None
    if not bounds:
        raise LayoutError(cluster.file, "--buckets", "is empty: give the bucket bounds, e.g. --buckets 128,512")
    if bounds[-1] == seq_len:
        bounds.pop()  # the home layout's bucket, given explicitly
    for a, b in zip(bounds, bounds[1:]):
        if b <= a:
            raise LayoutError(cluster.file, "--buckets", f"bounds must ascend strictly, got {a} then {b}")
    for b in bounds:
        if not 1 <= b < seq_len:
            raise LayoutError(
                cluster.file,
                "--buckets",
                f"bound {b} is outside 1..{seq_len - 1} (the last bucket is "
                f"model.seq_len = {seq_len}, the home layout's)",
            )
    return tuple(bounds) + (seq_len,)


MIN_GAIN = 1.05  # a bucket's own layout must be predicted this much faster than home's on its rows to be proposed
# (switching.worth then prices its switches and shard copies on whole steps)


def propose(cluster: Cluster, bounds: tuple[int, ...], home: Candidate) -> list[Bucket]:
    """A plan per bucket bound (the last, ``model.seq_len``, is the home layout)."""
    home_devices = {d for p in home.pipelines for s in p.stages for d in s.group.devices}
    out = []
    for bound in bounds[:-1]:
        # the home layout's train.optimizer holds for every bucket (``cluster`` is the planned one)
        shorter = attrs.evolve(
            cluster,
            model=attrs.evolve(cluster.model, seq_len=bound),
            limits=attrs.evolve(cluster.limits, optimizers=(cluster.train.optimizer.value,)),
        )
        result = plan_cluster(shorter, top=1)
        cand, score = result.best, result.score
        at_home = Planner(shorter).evaluate(home)  # the home layout on this bucket's rows
        devices = [d for p in cand.pipelines for s in p.stages for d in s.group.devices]
        if not set(devices) <= home_devices:
            out.append(Bucket(bound, None, None, "its plan uses devices the home layout leaves idle"))
        elif cand == home or (
            at_home is not None and at_home.feasible and score.step_time * MIN_GAIN > at_home.step_time
        ):
            home_s = f"{at_home.step_time:.4g}" if at_home is not None else "?"
            out.append(
                Bucket(
                    bound,
                    None,
                    None,
                    f"home layout: its own plan ({score.step_time:.4g} s) is not "
                    f"{MIN_GAIN:g}x faster than home's on its rows ({home_s} s)",
                )
            )
        else:
            out.append(Bucket(bound, cand, score, "" if at_home is None else f"{at_home.step_time:.4g}"))
    return out + [Bucket(bounds[-1], None, None, "the longest documents: the home layout")]
