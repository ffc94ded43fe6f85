"""``hetero-plan CLUSTER --evaluate LAYOUT``: the cost model's prediction for a layout a user wrote (or the
planner wrote), without searching: step time, tokens/s, TFLOP/s per device, MFU and memory per device.
Torch-free."""

from __future__ import annotations

import math

import attrs

from hetero_llm.errors import LayoutError
from hetero_llm.layout import Layout, Recompute, Schedule
from hetero_llm.planner.candidates import Candidate, PipelineChoice, Score, StageChoice, TPGroup
from hetero_llm.planner.catalogue import catalogue_kind
from hetero_llm.planner.cluster import Cluster, Node, PlanLimits, _network
from hetero_llm.planner.cost import PlannerCostModel

PRICED = (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED, Schedule.ZBH1)
# [train] keys the cost model takes from the cluster file: tokens and FLOPs per step, the device kinds' peak
# and the activation bytes, the optimizer's memory and time
PRICED_TRAIN = ("global_batch", "precision", "optimizer")


@attrs.frozen
class Evaluation:
    candidate: Candidate
    score: Score
    devices: int  # devices the layout uses
    model_flops: float  # per step, as the cost model counts them (6 N per token plus attention)

    @property
    def tflops_per_device(self) -> float:
        return self.model_flops / self.score.step_time / self.devices / 1e12 if self.score.feasible else 0.0


def cluster_for(layout: Layout, cluster: Cluster | None = None) -> Cluster:
    """The planner's cluster ``layout`` is priced on: ``cluster`` (a cluster file's device kinds, network and
    ``[plan]``) with the layout's own model, train and data sections, so a layout changed by ``--set`` is priced as
    it is; without one, the layout's own ``[cluster]``, whose nodes must then be CPU slots (kind ``cpu``)."""
    if cluster is None:
        spec, precision = layout.cluster, layout.train.precision
        nodes = []
        for i, n in enumerate(spec.nodes):
            if not all(d == "cpu" for d in n.devices):
                raise LayoutError(
                    layout.file,
                    f"cluster.nodes[{i}]",
                    f"node '{n.name}' has GPUs, whose device kind the layout does not say (evaluate it with the "
                    "cluster file it was planned from, whose [plan.nodes] names the kinds)",
                )
            nodes.append(Node(n.name, spec.domain_of(n.name), len(n.devices), catalogue_kind("cpu", precision)))
        return Cluster(
            layout.file, layout.model, layout.train, layout.data, spec, tuple(nodes), _network(spec), PlanLimits()
        )
    if layout.train.precision != cluster.train.precision:  # the device kinds' peaks are read at one precision
        raise LayoutError(
            layout.file,
            "train.precision",
            f"{layout.train.precision.value!r} differs from the cluster file's {cluster.train.precision.value!r} "
            f"({cluster.file}): its device kinds are priced at that precision (predict with a cluster file of "
            f"train.precision = {layout.train.precision.value!r})",
        )
    if cluster.profile is not None and layout.model != cluster.model:  # measured times are for one model's shapes
        raise LayoutError(
            layout.file,
            "model",
            f"differs from the cluster file's [model] ({cluster.file}), whose measured profile times that model only "
            "(predict without the profile, or profile this model: hetero-plan --profile)",
        )
    return attrs.evolve(cluster, model=layout.model, train=layout.train, data=layout.data)


def candidate_of(cluster: Cluster, layout: Layout, where: str) -> Candidate:
    """``layout``'s pipelines as a candidate on ``cluster``'s devices; a located ``LayoutError`` for a layout the
    cost model cannot price (a device the cluster file does not have, a schedule it does not simulate)."""
    schedule = layout.train.schedule
    if schedule not in PRICED:
        raise LayoutError(
            where,
            "train.schedule",
            f"'{schedule.value}' is not priced by the cost model (it prices "
            f"{', '.join(s.value for s in PRICED)}; evaluate the layout with one of those)",
        )
    nodes = {n.name: n for n in cluster.nodes}
    pipes = []
    for p, pipe in enumerate(layout.pipelines):
        stages = []
        for s, stage in enumerate(pipe.stages):
            names = {d.split(":")[0] for d in stage.devices}
            if len(names) != 1 or next(iter(names)) not in nodes:
                raise LayoutError(
                    where,
                    f"pipelines[{p}].stages[{s}].devices",
                    f"{list(stage.devices)} are not devices of one node of the cluster file {cluster.file} "
                    f"(its nodes: {', '.join(nodes)})",
                )
            if stage.cp > 1 and cluster.limits.attention != "flash":
                raise LayoutError(
                    where,
                    f"pipelines[{p}].stages[{s}].cp",
                    f"{stage.cp}: context parallelism is priced for flash attention only, but the cluster file's "
                    f"plan.attention is '{cluster.limits.attention}' (evaluate it with cp = 1, or plan.attention = "
                    "'flash')",
                )
            node = nodes[next(iter(names))]
            recompute = (stage.recompute or layout.train.recompute) is Recompute.FULL
            group = TPGroup(node.name, node.domain, tuple(stage.devices), node.kind, stage.cp, stage.cp_overlap)
            stages.append(StageChoice(group, stage.layers, recompute))
        pipes.append(PipelineChoice(pipe.batch, pipe.microbatches, tuple(stages)))
    chunks = layout.train.chunks if schedule is Schedule.INTERLEAVED else 1
    return Candidate(tuple(pipes), schedule.value, chunks, layout.train.optimizer.value)


def evaluate(cluster: Cluster, layout: Layout, where: str) -> Evaluation:
    """The cost model's prediction for ``layout`` on ``cluster`` (the same model, train and data sections are
    expected: the prediction is for the cluster file's model)."""
    if layout.model != cluster.model:
        raise LayoutError(
            where,
            "model",
            f"differs from the cluster file's [model] ({cluster.file}): the cost model predicts the cluster file's "
            "model (evaluate a layout planned from it, or give the layout's model to the cluster file)",
        )
    optimizer = layout.train.optimizer.value
    if optimizer in cluster.limits.optimizers:  # the planner chooses among these: priced as the layout says
        cluster = attrs.evolve(cluster, train=attrs.evolve(cluster.train, optimizer=layout.train.optimizer))
    for key in PRICED_TRAIN:  # what the cost model reads of [train]: a layout's own would be priced wrong, silently
        mine, theirs = getattr(layout.train, key), getattr(cluster.train, key)
        if mine != theirs:
            v, w = getattr(mine, "value", mine), getattr(theirs, "value", theirs)
            raise LayoutError(
                where,
                f"train.{key}",
                f"{v!r} differs from the cluster file's {w!r} ({cluster.file}): the cost model predicts the "
                f"cluster file's [train] (set train.{key} = {w!r} in the layout, or evaluate it with a cluster "
                f"file of train.{key} = {v!r})",
            )
    cand = candidate_of(cluster, layout, where)
    cost = PlannerCostModel(cluster)
    score = cost.score(cand)
    devices = sum(len(s.group.devices) for p in cand.pipelines for s in p.stages)
    return Evaluation(cand, score, devices, cost.model_flops_per_step())


def describe(ev: Evaluation) -> str:
    s = ev.score
    if not s.feasible:
        over = [
            f"pipeline {p} stage {i}: {m / 1e9:.3g} GB of {c / 1e9:.3g}"
            for p, (ms, cs) in enumerate(zip(s.memory, s.capacity))
            for i, (m, c) in enumerate(zip(ms, cs))
            if m > c
        ]
        return "PREDICTED: does not fit in memory (" + "; ".join(over) + ")"
    lines = [
        "PREDICTED by the planner's cost model (not measured):",
        f"  step time {s.step_time:.4g} s, {s.tokens_per_s:.4g} tokens/s, "
        f"{ev.tflops_per_device:.4g} TFLOP/s per device ({ev.devices} devices), MFU {s.mfu:.1%}",
        f"  bubble {s.bubble:.1%}, gradient sync {s.sync_time:.3g} s, optimizer {s.optimizer_time:.3g} s, "
        f"compute lower bound {s.lower_bound:.4g} s",
    ]
    for p, (ms, cs) in enumerate(zip(s.memory, s.capacity)):
        lines.append(
            f"  pipeline {p} memory GB per stage (of usable): "
            + " ".join(f"{m / 1e9:.3g}/{c / 1e9:.3g}" for m, c in zip(ms, cs))
        )
    return "\n".join(lines)


def to_json(ev: Evaluation) -> dict:
    s = ev.score
    return {
        "step_time": s.step_time if math.isfinite(s.step_time) else None,
        "fits": s.feasible,
        "tokens_per_s": s.tokens_per_s if s.feasible else None,
        "tflops_per_device": ev.tflops_per_device if s.feasible else None,
        "devices": ev.devices,
        "mfu": s.mfu if s.feasible else None,
        "bubble": s.bubble,
        "sync_time": s.sync_time,
        "optimizer_time": s.optimizer_time,
        "memory_gb": [[m / 1e9 for m in ms] for ms in s.memory],
        "capacity_gb": [[c / 1e9 for c in cs] for cs in s.capacity],
    }
