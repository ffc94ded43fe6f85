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
        seeds.append(from_placement(cluster, placement))
    return seeds


def from_placement(cluster: Cluster, placement: Placement) -> Candidate:
    """hetero-place's plan as a candidate (the search's seed)."""
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
    t = cluster.train
    schedule = t.schedule.value if t.schedule in (Schedule.ONE_F_ONE_B, Schedule.ZBH1, Schedule.INTERLEAVED) else "1f1b"
    return Candidate(tuple(pipes), schedule, t.chunks if schedule == "interleaved" else 1)
