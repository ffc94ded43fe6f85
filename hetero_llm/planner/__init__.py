"""``hetero-plan``: search the layouts a cluster can run for the fastest one under a cost model. Torch-free.

Modules, in data-flow order: ``cluster`` (the cluster file and device kinds), ``cost`` (time and
memory of a candidate), ``search`` (the exact splits, the sweep and the local search), ``output``
(the layout file and the explanation). ``plan_file`` is what the CLI calls.
"""

from __future__ import annotations

import os

from hetero_llm.planner.cluster import Cluster, load_cluster
from hetero_llm.planner.search import Planner, Result
from hetero_llm.planner.seeds import place_seeds
from hetero_llm.progress import Bar

__all__ = ["load_cluster", "place_seeds", "plan_cluster", "plan_file"]


def plan_cluster(cluster: Cluster, top: int = 5, budget_s: float | None = None, progress: bool = False) -> Result:
    """The search's result for ``cluster``; ``progress``: show the plans simulated (of the work budget) and the
    best predicted step so far on a terminal."""
    planner = Planner(cluster, budget_s=budget_s)
    with Bar("planning", planner.max_evals, "plans", enabled=None if progress else False) as bar:
        planner.progress = bar
        return planner.run(place_seeds(cluster), top=top)


def plan_file(
    path: str | os.PathLike, top: int = 5, profile_file: str | os.PathLike | None = None
) -> tuple[Cluster, Result]:
    cluster = load_cluster(path, profile_file)
    return cluster, plan_cluster(cluster, top)
