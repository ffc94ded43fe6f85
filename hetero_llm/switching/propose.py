"""Bucket layouts for hot switching (``hetero-plan --buckets 128,512``): a layout per document-length bucket.

The home layout is the planner's plan for the whole ``model.seq_len`` (it must hold the longest
documents and takes the optimizer step). For every shorter bound, the same search runs on the cluster
with ``seq_len`` set to that bound and ``train.global_batch`` set to the rows that bucket's documents fill
(``demand``: the most over the priced steps' documents, first-fit decreasing into rows of its bound, as a step
packs them), context parallelism included (``plan.max_cp``): rows of that width, so the activations (memory,
against each device kind's ``memory_gb``) and the compute (attention included) are the bucket's; its plan becomes
the bucket's ``[[buckets.pipelines]]`` (each stage its own ``cp``), schedule and chunks. A bucket whose plan equals the home layout, or
uses a device the home layout leaves idle (a bucket runs on the home layout's processes), runs under
the home layout instead. ``switching.worth.judge`` then prices whole steps with these buckets (their switches and
the memory they hold) against the best static plan, and keeps them only where that pays: the two
are hot switching's decisions, in this package. Torch-free, like the planner.
"""

from __future__ import annotations

import attrs

from hetero_llm.errors import LayoutError
from hetero_llm.planner import plan_cluster
from hetero_llm.planner.buckets import Bucket
from hetero_llm.planner.candidates import Candidate
from hetero_llm.planner.cluster import Cluster
from hetero_llm.planner.cost import PlannerCostModel
from hetero_llm.switching import bucketing
from hetero_llm.switching.worth import STEPS, home_resident, pipe_seconds, step_documents


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
# (switching.worth then prices its switches and the memory it holds on whole steps)


def demand(cluster: Cluster, bounds: tuple[int, ...]) -> tuple[int, ...]:
    """The rows each bucket's documents fill, the most over the first ``worth.STEPS`` steps: the documents training
    draws (``documents.fill_documents``) sorted by length into the buckets and packed first-fit decreasing into
    rows of their bound, every bucket but the shortest topped up with shorter documents, as the planned layout
    writes them (``bucketing.placed``, what ``bucketing.bucket_rows`` pads); at least 1."""
    most = [1] * len(bounds)
    top_up = [i > 0 for i in range(len(bounds))]  # planner/output.bucket_specs
    for step in range(max(1, min(STEPS, cluster.train.steps))):
        _, rows_of = bucketing.placed(list(bounds), top_up, step_documents(cluster, step))
        for i, rows in enumerate(rows_of):
            if rows:
                most[i] = max(most[i], max(rows) + 1)
    return tuple(most)


def beside_home(cluster: Cluster, home: Candidate) -> Cluster:
    """The cluster with each device kind's ``memory_gb`` less what home keeps on its devices of that kind whatever
    layout runs (its weights, gradients and moments: ``worth.home_resident``, the most on one device), so a bucket
    searched on it fits beside home: a bucket layout holds its shards and gradients and its activations, which its
    own search counts together with moments it does not hold (the bound is safe)."""
    kept: dict[str, float] = {}
    resident = home_resident(cluster, home)
    for p in home.pipelines:
        for st in p.stages:
            name = st.group.kind.name
            kept[name] = max(kept.get(name, 0.0), resident[st.group.devices[0]])
    nodes = tuple(
        attrs.evolve(
            n, kind=attrs.evolve(n.kind, memory_gb=max(0.0, n.kind.memory_gb - kept.get(n.kind.name, 0.0) / 1e9))
        )
        for n in cluster.nodes
    )
    return attrs.evolve(cluster, nodes=nodes)


def propose(cluster: Cluster, bounds: tuple[int, ...], home: Candidate) -> list[Bucket]:
    """A plan per bucket bound (the last, ``model.seq_len``, is the home layout), each on its documents' rows."""
    home_devices = {d for p in home.pipelines for s in p.stages for d in s.group.devices}
    rows_of = demand(cluster, bounds)
    room = beside_home(cluster, home)
    out = []
    for bound, rows in zip(bounds[:-1], rows_of):
        # the home layout's train.optimizer holds for every bucket (``cluster`` is the planned one)
        shorter = attrs.evolve(
            room,
            model=attrs.evolve(cluster.model, seq_len=bound),
            train=attrs.evolve(cluster.train, global_batch=rows),
            limits=attrs.evolve(cluster.limits, optimizers=(cluster.train.optimizer.value,)),
        )
        try:
            result = plan_cluster(shorter, top=1)
        except LayoutError:  # nothing fits beside home's storage
            result = None
        if result is None or not result.score.feasible:
            out.append(Bucket(bound, None, None, "home layout: no plan of its rows fits beside home's storage"))
            continue
        cand, score = result.best, result.score
        # the home layout on rows of this width, per row (its pipelines; home syncs and steps once either way)
        at = attrs.evolve(cluster, model=shorter.model)
        at_home = PlannerCostModel(at).score(home)
        home_row = pipe_seconds(at_home) / cluster.train.global_batch
        own_row = pipe_seconds(score) / rows
        devices = [d for p in cand.pipelines for s in p.stages for d in s.group.devices]
        if not set(devices) <= home_devices:
            out.append(Bucket(bound, None, None, "its plan uses devices the home layout leaves idle"))
        elif cand == home or (at_home.feasible and own_row * MIN_GAIN > home_row):
            out.append(
                Bucket(
                    bound,
                    None,
                    None,
                    f"home layout: its own plan ({own_row:.4g} s per row of {rows}) is not "
                    f"{MIN_GAIN:g}x faster than home's on its rows ({home_row:.4g} s per row)",
                )
            )
        else:
            out.append(Bucket(bound, cand, score, f"{at_home.step_time:.4g}" if at_home.feasible else ""))
    return out + [Bucket(bounds[-1], None, None, "the longest documents: the home layout")]
