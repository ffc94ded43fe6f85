"""A hot-switching bucket as the planner writes it (``[[buckets]]`` of a planned layout, ``planner/output.py``): its
bound, its plan (None: the home layout) and why. Which buckets to plan and whether they pay are decided in
``switching/propose.py`` and ``switching/worth.py``. Torch-free, like the planner.
"""

from __future__ import annotations

import math

import attrs

from hetero_llm.planner.candidates import Candidate, Score


@attrs.frozen
class Bucket:
    max_len: int
    plan: Candidate | None  # None: the home layout
    score: Score | None
    why_home: str = ""  # why a bucket runs under the home layout (with a plan: home's predicted step s, if known)


def elastic_unit(plan: Candidate) -> int | None:
    """The factor an elastic bucket divides the plan's pipeline batches and microbatches by (their microbatches'
    greatest common divisor), or None where an elastic bucket could hold more activations than the plan was
    checked for: only 1F1B and ZB-H1 bound what a stage holds by the stage count whatever the microbatches,
    and only once every pipeline has at least as many microbatches as stages (as planned)."""
    if plan.schedule not in ("1f1b", "zbh1") or any(p.microbatches < len(p.stages) for p in plan.pipelines):
        return None
    return math.gcd(*(p.microbatches for p in plan.pipelines))
