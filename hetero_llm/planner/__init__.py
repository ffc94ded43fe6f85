"""``hetero-plan``: search the layouts a cluster can run for the fastest one under a cost model. Torch-free.

Modules, in data-flow order: ``cluster`` (the cluster file and device kinds), ``cost`` (time and
memory of a candidate), ``search`` (the exact splits, the sweep and the local search), ``output``
(the layout file and the explanation). ``plan_file`` is what the CLI calls.
"""

from __future__ import annotations

import itertools
import os

import attrs

from hetero_llm.errors import LayoutError
from hetero_llm.planner.cluster import Cluster, load_cluster
from hetero_llm.planner.cost import Candidate
from hetero_llm.planner.search import Planner, Result


def place_seeds(cluster: Cluster) -> list[Candidate]:
    """hetero-place's plans for this cluster (every TP size and a few pipeline counts it accepts), as the search's seeds.

    Placement reads ``speed`` and ``memory_gb`` from the nodes: they are set from the device kinds,
    as a user of hetero-place on this cluster would set them.
    """
    from hetero_llm.planner import place
    from hetero_llm.planner.output import from_placement

    fastest = max(n.kind.tflops for n in cluster.nodes)
    nodes = tuple(attrs.evolve(spec, speed=node.kind.tflops / fastest, memory_gb=node.kind.memory_gb)
                  for spec, node in zip(cluster.spec.nodes, cluster.nodes))
    spec = attrs.evolve(cluster.spec, nodes=nodes)
    seeds = []
    for tp, pipelines in itertools.product((1, 2, 4, 8), (0, 1, 2, 4, 8, 16)):
        try:
            placement = place.place(cluster.file, cluster.model, cluster.train, spec, place.PlaceOptions(pipelines, tp))
        except (LayoutError, AssertionError):
            continue
        seeds.append(from_placement(cluster, placement))
    return seeds


def plan_cluster(cluster: Cluster, top: int = 5, budget_s: float | None = None) -> Result:
    planner = Planner(cluster, budget_s=budget_s)
    return planner.run(place_seeds(cluster), top=top)


def plan_file(path: str | os.PathLike, top: int = 5, profile_file: str | os.PathLike | None = None
              ) -> tuple[Cluster, Result]:
    cluster = load_cluster(path, profile_file)
    return cluster, plan_cluster(cluster, top)
