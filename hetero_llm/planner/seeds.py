"""The search's seeds: hetero-place's NIC-aware placements of the cluster (Holmes), as candidates. Torch-free."""

from __future__ import annotations

import itertools

import attrs

from hetero_llm.errors import LayoutError
from hetero_llm.layout import Recompute, Schedule
from hetero_llm.planner import place
from hetero_llm.planner.candidates import Candidate, PipelineChoice, StageChoice, TPGroup
from hetero_llm.planner.cluster import Cluster
from hetero_llm.planner.place import Placement


def place_seeds(cluster: Cluster) -> list[Candidate]:
    """hetero-place's plans for this cluster (every TP size and a few pipeline counts it accepts), as the search's seeds.

    Placement reads ``speed`` and ``memory_gb`` from the nodes: they are set from the device kinds,
    as a user of hetero-place on this cluster would set them.
    """
    fastest = max(n.kind.tflops for n in cluster.nodes)
    nodes = tuple(
        attrs.evolve(spec, speed=node.kind.tflops / fastest, memory_gb=node.kind.memory_gb)
        for spec, node in zip(cluster.spec.nodes, cluster.nodes)
    )
    spec = attrs.evolve(cluster.spec, nodes=nodes)
    seeds = []
    for tp, pipelines in itertools.product((1, 2, 4, 8), (0, 1, 2, 4, 8, 16)):
        try:
            placement = place.place(cluster.file, cluster.model, cluster.train, spec, place.PlaceOptions(pipelines, tp))
        except (LayoutError, AssertionError):
            continue
        seed = from_placement(cluster, placement)
        if seed is not None:
            seeds.append(seed)
    return seeds


def from_placement(cluster: Cluster, placement: Placement) -> Candidate | None:
    """hetero-place's plan as a candidate (the search's seed), under a schedule ``plan.schedules`` allows:
    train.schedule when it does, else the first allowed one; None when that schedule cannot run the placement
    (interleaved: a pipeline of one stage, microbatches not a multiple of the stages, layers not of the chunks)."""
    pipes = []
    for p in placement.pipelines:
        stages = tuple(
            StageChoice(
                TPGroup(s.unit.node, s.unit.domain, s.unit.devices, cluster.node(s.unit.node).kind),
                s.layers,
                cluster.train.recompute is Recompute.FULL,
            )
            for s in p.stages
        )
        pipes.append(PipelineChoice(p.batch, p.microbatches, stages))
    t, allowed = cluster.train, cluster.limits.schedules
    schedule = t.schedule.value if t.schedule.value in allowed else allowed[0]
    chunks = 1
    if schedule == "interleaved":
        chunks = t.chunks if t.schedule is Schedule.INTERLEAVED and t.chunks >= 2 else 2
        for pipe in pipes:
            n = len(pipe.stages)
            if n < 2 or pipe.microbatches % n or any(s.layers % chunks for s in pipe.stages):
                return None
    return Candidate(tuple(pipes), schedule, chunks)
