"""The spans of layers between two consecutive stage boundaries of any pipeline, and which stage of each
pipeline holds each span, as numpy arrays: what the gradient sync (``cost.grad_sync_time``) and ZeRO-1's
moment slices (``memory.moments``) sum over. Torch-free.

The search prices thousands of candidates of hundreds of stages; these arrays replace the per-span Python
loops with the same arithmetic. Every sum keeps the loops' order (a float sum's last bits depend on it, and a
plan's ranking on those): ``np.bincount`` adds its weights one at a time in array order, and a cumulative sum
along a row is sequential, where ``np.sum`` would add pairwise (tests/unit/test_planner_fast_paths.py pins each result to
the plain loop's, bit for bit, on random candidates).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import attrs
import numpy as np

from hetero_llm.planner.candidates import Candidate, StageChoice

# the columns of ``Spans.facts``: what the sums need of each stage's TP group (``MemoryModel.group_facts``)
# the memory model's: the cluster's node index, the group's own index, TP size, its node's memory_gb, its memory
# bandwidth, one of its devices' parameters of one layer, of the embedding and of the head; then the cost model's
NODE, UID, TP, NODE_MEMORY, MEM_BW, LAYER_PARAMS, EMBED_PARAMS, HEAD_PARAMS = range(8)
DOMAIN, INTRA_BW, DOMAIN_BW = range(8, 11)


@attrs.frozen(eq=False)
class Spans:
    """``lo``, ``hi``: each span's layers [lo, hi); ``owner[span, pipeline]``: the holding stage, as an index into
    ``stages`` (every stage of every pipeline, pipeline by pipeline); ``first`` and ``last``: each pipeline's
    first and last stage's index; ``layers``: each stage's; ``facts[stage, column]``: its group's facts (the
    columns above)."""

    lo: np.ndarray
    hi: np.ndarray
    owner: np.ndarray
    stages: tuple[StageChoice, ...]
    first: np.ndarray
    last: np.ndarray
    layers: np.ndarray
    facts: np.ndarray

    @staticmethod
    def of(
        cand: Candidate, layers: int, rows: Callable[[tuple[StageChoice, ...]], tuple[np.ndarray, np.ndarray]]
    ) -> Spans:
        """The spans of ``cand``, whose every pipeline holds the model's ``layers`` layers; ``rows``: a pipeline's
        stages' layers and rows of ``facts`` (``MemoryModel.pipeline_rows``)."""
        stages = tuple(itertools.chain.from_iterable(p.stages for p in cand.pipelines))
        counts = np.asarray([len(p.stages) for p in cand.pipelines])
        first = np.cumsum(counts) - counts
        last = first + counts - 1
        each = [rows(p.stages) for p in cand.pipelines]
        per = np.concatenate([x[0] for x in each])
        pipe = np.repeat(np.arange(len(counts)), counts)
        total = np.cumsum(per)
        ends = total - (total[first] - per[first])[pipe]  # each stage's last layer + 1 in its pipeline
        if (per < 0).any() or (ends[last] != layers).any():
            raise ValueError(f"a pipeline of the candidate does not hold the model's {layers} layers: {per.tolist()}")
        cuts = np.unique(np.concatenate(([0], ends)))
        lo, hi = cuts[:-1], cuts[1:]
        # the stage of pipeline p holding [lo, hi): the first whose end passes lo. Pipeline p's ends shifted by
        # p (layers + 1) are in order over all pipelines, so one search finds every pipeline's holder
        shift = (layers + 1) * np.arange(len(counts))
        owner = np.searchsorted(ends + shift[pipe], lo[:, None] + shift[None, :], side="right")
        return Spans(lo, hi, owner, stages, first, last, per, np.concatenate([x[1] for x in each]))

    def per_stage(self, column: int) -> np.ndarray:
        """A column of ``facts`` by ``owner``: one per span and pipeline."""
        return self.facts[:, column][self.owner]


def ordered_sums(index: np.ndarray, weights: np.ndarray, n: int) -> np.ndarray:
    """Per index, the sum of its weights added one at a time in array order from 0.0 (a loop's ``d[i] += w``)."""
    return np.bincount(index.ravel(), weights=weights.ravel(), minlength=n)
