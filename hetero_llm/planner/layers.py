"""The exact layer split of the planner's search: each pipeline's layers cut into stages whose slowest is
fastest, every stage inside its memory. Torch-free, deterministic.

A min-max dynamic program over contiguous splits (layers in multiples of the model chunks) gives each pipeline
the split whose slowest stage (forward + backward of one microbatch, TP all-reduces included) is fastest, with
every stage inside its memory (a stage that does not fit without recompute may recompute). Stage costs depend
on the device kind and TP size only (and with ZeRO-1 the node's memory_gb): one representative group of each
keeps the memos small. ``search.Planner`` is a ``LayerSplitter``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from hetero_llm.planner import pipesim
from hetero_llm.planner.candidates import TPGroup
from hetero_llm.planner.cost import PlannerCostModel
from hetero_llm.planner.memory import ONE_IN_FLIGHT
from hetero_llm.planner.structure import Structure

INF = math.inf


class StageTimes(NamedTuple):
    """What the search's closed-form estimate and lower bound take of a pipeline's stages (``split_and_fill``):
    ``total`` and ``slowest`` of one microbatch's stage times (the cheapest way each stage fits one microbatch,
    or with ZeRO-1 as the split chose), and per stage ``busy``, its forward + backward seconds as the split
    chose, and ``before``, the forwards of the stages before it over the model chunks."""

    total: float
    slowest: float
    before: tuple[float, ...]
    busy: tuple[float, ...]


class LayerSplitter:
    """Stage costs and the layer split of pipelines on one cluster, memoised (the search asks often)."""

    def __init__(self, cost: PlannerCostModel, layers: int):
        self.cost = cost
        self.L = layers
        self._splits: dict[tuple, tuple | None] = {}
        self._fills: dict[tuple, tuple] = {}  # split_and_fill's, by the split's key
        self._light: dict[tuple[TPGroup, ...], tuple[float, float]] = {}  # zero1_others' per pipeline
        self._stage_keys: dict[tuple[TPGroup, ...], tuple] = {}
        self._rows: dict[tuple, np.ndarray] = {}
        self._tail_index: dict[tuple[int, int], np.ndarray] = {}
        self._rep: dict[tuple[str, int], TPGroup] = {}
        self._stage_cost = functools.lru_cache(maxsize=500_000)(self._stage_cost_raw)

    def stage_cost(
        self,
        g: TPGroup,
        layers: int,
        first: bool,
        last: bool,
        rows: int,
        in_flight: pipesim.Held,
        others: tuple[float, float] = (0.0, 0.0),
    ) -> tuple[float, bool]:
        return self._stage_cost(self._rep.setdefault(self._rep_key(g), g), layers, first, last, rows, in_flight, others)

    def _stage_cost_raw(
        self,
        group: TPGroup,
        layers: int,
        first: bool,
        last: bool,
        rows: int,
        in_flight: pipesim.Held,
        others: tuple[float, float] = (0.0, 0.0),
    ) -> tuple[float, bool]:
        """(forward + backward seconds, recompute) of the cheapest way the stage fits; (inf, _) if none.
        ``others``: with ZeRO-1, a lower bound of the other pipelines' holders' weight (``zero1_others``)."""
        cap = self.cost.capacity(group)
        for rc in (False, True):
            if self.cost.stage_memory(group, layers, first, last, rows, rc, in_flight, others) <= cap:
                f, b, _, _ = self.cost.stage_times(group, layers, last, rows, rc)
                return f + b, rc
        return INF, True

    def split_layers(
        self,
        groups: tuple[TPGroup, ...],
        rows: int,
        schedule: str,
        chunks: int,
        microbatches: int,
        others: tuple[float, float] = (0.0, 0.0),
    ) -> tuple[tuple[int, ...], tuple[bool, ...], float] | None:
        """Min-max DP: layers per stage (multiples of ``chunks``), recompute flags, slowest stage time."""
        return self._split_memo(groups, rows, schedule, chunks, microbatches, others)[1]

    def _memo_key(self, groups, rows, schedule, chunks, microbatches, others) -> tuple | None:
        """What ``split_layers`` depends on (None: a split the layout refuses)."""
        k = len(groups)
        if schedule == "interleaved" and k == 1:  # the layout refuses it (interleaving needs 2 stages)
            return None
        # peaks in flight stop growing once microbatches reach the stages (x chunks): cap m there for the memo
        if schedule == "gpipe":  # every microbatch's activations are in flight at once: no cap
            m = microbatches
        else:
            m = max(microbatches, k) if schedule != "interleaved" else k * max(1, -(-microbatches // k))
            m = min(m, k * (chunks + 1))
        return (self._stage_key(groups), rows, schedule, chunks, m, others)

    def _split_memo(self, groups, rows, schedule, chunks, microbatches, others) -> tuple[tuple, tuple | None]:
        """(memo key, ``split_layers``)."""
        key = self._memo_key(groups, rows, schedule, chunks, microbatches, others)
        if key is None:
            return (), None
        return key, self._split_of(key, groups)

    def _split_of(self, key: tuple, groups) -> tuple | None:
        """``split_layers`` of ``groups`` under its memo key (``_memo_key``: stages, rows, schedule, chunks, m,
        others)."""
        if key not in self._splits:
            self._splits[key] = self._split_layers(groups, *key[1:])
        return self._splits[key]

    def split_and_fill(
        self,
        groups: tuple[TPGroup, ...],
        rows: int,
        schedule: str,
        chunks: int,
        microbatches: int,
        others: tuple[float, float] = (0.0, 0.0),
    ) -> tuple[tuple[tuple[int, ...], tuple[bool, ...], float] | None, float, StageTimes | None]:
        """``split_layers``; the sum of its stages' times for one microbatch in flight (the pipeline's fill, what
        the batch split needs); and what ``search``'s estimate and bound take of its stages' times. All memoised
        alike: they are functions of the split's memo key."""
        key = self._memo_key(groups, rows, schedule, chunks, microbatches, others)
        if key is None:
            return None, 0.0, None
        known = self._fills.get(key)
        if known is None:
            split = self._split_of(key, groups)
            if split is None:
                known = self._fills[key] = (None, 0.0, None)
            else:
                known = self._fills[key] = (split, *self._fill_and_times(groups, split, rows, chunks, others))
        return known

    def _fill_and_times(self, groups, split, rows: int, chunks: int, others) -> tuple[float, StageTimes]:
        """The fill: the sum of the stages' forward + backward seconds of one microbatch, each the cheapest way it
        fits one microbatch in flight (``stage_cost``); and the ``StageTimes`` of the split."""
        rep, rep_key, n = self._rep, self._rep_key, len(groups)
        terms = [
            self._stage_cost(rep.setdefault(rep_key(g), g), l, i == 0, i == n - 1, rows, ONE_IN_FLIGHT, others)[0]
            for i, (g, l) in enumerate(zip(groups, split[0]))
        ]
        fill = sum(terms)
        # each stage's forward + backward seconds as the split chose it, and the forwards before it / chunks
        busy, before, ahead = [], [], 0.0
        for i, (g, l, rc) in enumerate(zip(groups, split[0], split[1])):
            f, b, _, _ = self.cost.stage_times(g, l, i == n - 1, rows, rc)
            busy.append(f + b)
            before.append(ahead)
            ahead += f / chunks
        if not self.cost.zero1:
            return fill, StageTimes(fill, max(terms), tuple(before), tuple(busy))
        return fill, StageTimes(sum(busy), max(busy), tuple(before), tuple(busy))

    def _stage_key(self, groups) -> tuple:
        """What a stage's cost depends on: kind and TP size (and with ZeRO-1 its node's memory_gb); memoised by
        the groups (one hash of the tuple instead of a key built per group)."""
        key = self._stage_keys.get(groups)
        if key is None:
            key = self._stage_keys[groups] = tuple(self._rep_key(g) for g in groups)
        return key

    def _rep_key(self, g: TPGroup) -> tuple:
        # built afresh: cheaper than a dict lookup keyed by the TPGroup (attrs equality on every hit)
        if self.cost.zero1:
            return (g.kind.name, len(g.devices), self.cost.node_memory.get(g.node, 0.0), g.cp)
        return (g.kind.name, len(g.devices), g.cp)

    def _cost_row(
        self,
        g: TPGroup,
        unit: int,
        top_units: int,
        first: bool,
        last: bool,
        rows: int,
        in_flight: pipesim.Held,
        others: tuple[float, float],
    ) -> np.ndarray:
        """[time of the stage holding 1 unit, 2 units, ... top_units] (inf: does not fit); memoised."""
        key = (g, unit, top_units, first, last, rows, in_flight, others)
        row = self._rows.get(key)
        if row is None:
            times = []
            for u in range(1, top_units + 1):
                c, _ = self._stage_cost(g, u * unit, first, last, rows, in_flight, others)
                times.append(c)
                if c == INF:
                    times += [INF] * (top_units - u)  # more layers never fit where fewer did not
                    break
            row = self._rows[key] = np.asarray(times)
        return row

    def _split_layers(self, groups, rows, schedule, chunks, m, others):
        # stage costs depend on the kind and TP size only: one representative each keeps the cache small
        groups = [self._rep.setdefault(self._rep_key(g), g) for g in groups]
        k, unit = len(groups), chunks
        if self.L % unit or self.L // unit < k:
            return None
        peaks = self.cost._peaks(schedule, k, m, chunks)
        n = self.L // unit
        # cost[i][u]: time of stage i holding u units (inf: does not fit); at most n - (k - 1) units
        top_units = n - k + 1
        cost = [
            self._cost_row(g, unit, top_units, i == 0, i == k - 1, rows, peaks[i], others) for i, g in enumerate(groups)
        ]
        # best[r]: slowest stage time of stages i.. holding r units, built from the last stage back (numpy:
        # for every r at once, the first u of the least max(cost[i][u], best[r - u]), as a loop over u would)
        # tail[r, u - 1] = best[r - u] read from best padded with inf in front (r - u <= 0: nothing left)
        index = self._tail_index.get((n, top_units))
        if index is None:
            index = self._tail_index[(n, top_units)] = (
                np.arange(n + 1)[:, None] - np.arange(1, top_units + 1)[None, :] + top_units
            )
        rows_at = np.arange(n + 1)
        padded = np.full(top_units + n + 1, INF)  # best, with inf in front
        best = padded[top_units:]
        best[1 : top_units + 1] = cost[k - 1]
        choice = []
        for i in range(k - 2, -1, -1):
            both = np.maximum(cost[i], padded[index])
            pick = both.argmin(axis=1)
            best[:] = both[rows_at, pick]
            choice.append(pick + 1)
        if not best[n] < INF:
            return None
        t, units, r = float(best[n]), [], n  # units: each group's layers in units of ``unit``
        for pick in reversed(choice):
            units.append(int(pick[r]))
            r -= units[-1]
        units.append(r)
        split = tuple(u * unit for u in units)
        flags = tuple(
            self._stage_cost(g, l, i == 0, i == k - 1, rows, peaks[i], others)[1]
            for i, (g, l) in enumerate(zip(groups, split))
        )
        return split, flags, t

    def zero1_others(self, st: Structure) -> list[tuple[float, float]]:
        """Per pipeline, with ZeRO-1: a lower bound of the weight of the other pipelines' holders of any
        layer (each other pipeline holds it on one of its groups: at least its lightest), so the DP's
        memory is an upper bound of what ``cost.moments`` gives the realized plan. (0, 0) otherwise."""
        if not self.cost.zero1 or len(st.pipelines) == 1:
            return [(0.0, 0.0)] * len(st.pipelines)
        light = []
        for p in st.pipelines:
            x = self._light.get(p)
            if x is None:
                x = self._light[p] = (
                    min(self.cost.zero1_weights(g)[0] for g in p),
                    min(self.cost.zero1_weights(g)[1] for g in p),
                )
            light.append(x)
        total = tuple(sum(x[j] for x in light) for j in (0, 1))
        return [(total[0] - x[0], total[1] - x[1]) for x in light]
