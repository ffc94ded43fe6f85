"""The layer split of the planner's search: each pipeline's layers cut into stages so that its step is
shortest, every stage inside its memory. Torch-free, deterministic.

A pipeline of stage times t_i (forward + backward of one microbatch, TP all-reduces included) and m microbatches
takes about ``sum(t) + (m - 1) max(t)`` (1F1B, GPipe: the fill and drain pass every stage once, the bottleneck
runs every other microbatch), so neither the fastest slowest stage nor the least sum alone is the fastest step.
Two exact dynamic programs over contiguous splits (layers in multiples of the model chunks) give each pipeline
its **front** (``front_and_fills``): the min-max split (``split_layers``: the slowest stage fastest), then for every
bound M on a stage's time between that slowest stage and the slowest stage of the least-sum split, the split of
least sum whose stages all take at most M, kept where it lowers the sum (every split that is best for some m:
``sum + (m - 1) max`` is least on this front, for every m). ``search.Planner`` takes the front's split of the
least ``fill + (m - 1) slowest`` at the pipeline's microbatch count, confirmed against the min-max split and the
next best by the pipeline simulator (``pick``). Every stage fits its memory (a stage that does not fit without
recompute may recompute). Stage costs depend on the device kind and TP size only (and with ZeRO-1 the node's
memory_gb): one representative group of each keeps the memos small. ``search.Planner`` is a ``LayerSplitter``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from hetero_llm.planner import pipesim
from hetero_llm.planner.candidates import PipelineChoice, StageChoice, TPGroup
from hetero_llm.planner.cost import PlannerCostModel
from hetero_llm.planner.memory import ONE_IN_FLIGHT
from hetero_llm.planner.structure import Structure

INF = math.inf
MAX_BOUNDS = 96  # bounds M per front (more distinct stage times in the window: evenly spaced ones among them)
CONFIRMED = 3  # front splits the simulator confirms per pipeline: the best by the closed form, and the min-max


class StageTimes(NamedTuple):
    """What the search's closed-form estimate and lower bound take of a pipeline's stages (``split_and_fill``):
    ``total`` and ``slowest`` of one microbatch's stage times (the cheapest way each stage fits one microbatch,
    or with ZeRO-1 as the split chose), and per stage ``busy``, its forward + backward seconds as the split
    chose, and ``before``, the forwards of the stages before it over the model chunks."""

    total: float
    slowest: float
    before: tuple[float, ...]
    busy: tuple[float, ...]


class Point(NamedTuple):
    """One split of a pipeline's front: layers and recompute flags per stage, the slowest stage's time and the sum
    of the stages' times (each as the DP prices it: the cheapest way it fits the schedule's peak in flight)."""

    split: tuple[int, ...]
    flags: tuple[bool, ...]
    slowest: float
    total: float


class LayerSplitter:
    """Stage costs and the layer split of pipelines on one cluster, memoised (the search asks often)."""

    def __init__(self, cost: PlannerCostModel, layers: int):
        self.cost = cost
        self.L = layers
        self._splits: dict[tuple, tuple | None] = {}
        self._fronts: dict[tuple, tuple[Point, ...]] = {}  # the fronts (front_and_fills), by the split's key
        self._point_fills: dict[tuple, tuple[float, StageTimes]] = {}  # by (key, split)
        self._fills: dict[tuple, tuple] = {}  # front_and_fills' fills, by the split's key
        self._stages: dict[tuple, tuple[StageChoice, ...]] = {}  # stage_tuple's, by (groups, layers, recompute)
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

    def front_and_fills(
        self,
        groups: tuple[TPGroup, ...],
        rows: int,
        schedule: str,
        chunks: int,
        microbatches: int,
        others: tuple[float, float] = (0.0, 0.0),
    ) -> tuple[tuple[Point, ...], tuple[tuple[float, StageTimes], ...]]:
        """The pipeline's front (the module's docstring: the min-max split first, then splits of less sum and a
        slower slowest stage, each the least sum under its bound; () where no split fits) and per split of it the
        sum of its stages' times for one microbatch in flight (the pipeline's fill, what the batch split needs)
        and what ``search``'s estimate and bound take of its stages' times (``StageTimes``); memoised by the
        split's memo key."""
        key = self._memo_key(groups, rows, schedule, chunks, microbatches, others)
        if key is None:
            return (), ()
        front = self._front_of(key, groups)
        fills = self._fills.get(key)
        if fills is None:
            fills = self._fills[key] = tuple(self._fill_and_times(groups, p, rows, chunks, others) for p in front)
        return front, fills

    def pick(
        self,
        groups: tuple[TPGroup, ...],
        front: tuple[Point, ...],
        fills: tuple[tuple[float, StageTimes], ...],
        microbatches: int,
        rows: int,
        schedule: str,
        chunks: int,
    ) -> int:
        """The index in ``front`` of the split whose step is shortest at ``microbatches``: the ``CONFIRMED`` best
        by ``fill / chunks + (m - 1) slowest`` (the batch split's closed form, its fill over the chunks under
        interleaving) and the min-max split, each simulated (``cost.pipeline_time``), the fastest (the lower
        index on a tie)."""
        if len(front) == 1 or microbatches < 1:
            return 0
        c = chunks if schedule == "interleaved" and len(groups) > 1 else 1
        closed = [f / c + (microbatches - 1) * p.slowest for p, (f, _) in zip(front, fills)]
        order = sorted(range(len(front)), key=lambda j: (closed[j], j))
        tried = sorted({0, *order[:CONFIRMED]})

        def step(j: int) -> float:
            stages = self.stage_tuple(groups, front[j].split, front[j].flags)
            return self.cost.pipeline_time(PipelineChoice(microbatches * rows, microbatches, stages), schedule, chunks)[
                0
            ]

        return min(tried, key=lambda j: (step(j), j))

    def stage_tuple(self, groups, layers: tuple[int, ...], flags: tuple[bool, ...]) -> tuple[StageChoice, ...]:
        """The stages of ``groups`` holding ``layers`` with ``flags``: the same tuple each time (the cost model's
        memos find a pipeline by its stages' tuple)."""
        stages = self._stages.get((groups, layers, flags))
        if stages is None:
            stages = self._stages[groups, layers, flags] = tuple(map(StageChoice, groups, layers, flags))
        return stages

    def _front_of(self, key: tuple, groups) -> tuple[Point, ...]:
        front = self._fronts.get(key)
        if front is None:
            first = self._split_of(key, groups)
            front = self._fronts[key] = () if first is None else self._split_front(groups, first, *key[1:])
        return front

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

    def _dp_rows(self, groups, rows, schedule, chunks, m, others) -> tuple | None:
        """(representative groups, units, cost rows, peaks) of the DPs, or None when the layers do not cut into
        one unit (``chunks`` layers) per stage at least. ``cost[i][u - 1]``: the time of stage i holding u units
        (inf: does not fit); at most n - (k - 1) units."""
        # stage costs depend on the kind and TP size only: one representative each keeps the cache small
        groups = [self._rep.setdefault(self._rep_key(g), g) for g in groups]
        k, unit = len(groups), chunks
        if self.L % unit or self.L // unit < k:
            return None
        peaks = self.cost._peaks(schedule, k, m, chunks)
        n = self.L // unit
        top_units = n - k + 1
        cost = [
            self._cost_row(g, unit, top_units, i == 0, i == k - 1, rows, peaks[i], others) for i, g in enumerate(groups)
        ]
        return groups, n, cost, peaks

    def _index(self, n: int, top_units: int) -> np.ndarray:
        """index[r, u - 1] = r - u + top_units: where best[r - u] lies in best padded with top_units inf in front."""
        index = self._tail_index.get((n, top_units))
        if index is None:
            index = self._tail_index[(n, top_units)] = (
                np.arange(n + 1)[:, None] - np.arange(1, top_units + 1)[None, :] + top_units
            )
        return index

    def _split_layers(self, groups, rows, schedule, chunks, m, others):
        made = self._dp_rows(groups, rows, schedule, chunks, m, others)
        if made is None:
            return None
        groups, n, cost, peaks = made
        k, unit, top_units = len(groups), chunks, n - len(groups) + 1
        # best[r]: slowest stage time of stages i.. holding r units, built from the last stage back (numpy:
        # for every r at once, the first u of the least max(cost[i][u], best[r - u]), as a loop over u would)
        # tail[r, u - 1] = best[r - u] read from best padded with inf in front (r - u <= 0: nothing left)
        index = self._index(n, top_units)
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

    def _split_front(self, groups, first, rows, schedule, chunks, m, others) -> tuple[Point, ...]:
        """The front from the min-max split ``first`` (``_split_layers``'s): the least-sum DP under every
        bound M between its slowest stage and the slowest stage of the least-sum split (the distinct stage times
        there, at most ``MAX_BOUNDS`` of them evenly spaced), each split kept where its sum is less than every
        split's before it (bounds ascending)."""
        made = self._dp_rows(groups, rows, schedule, chunks, m, others)
        assert made is not None  # the min-max split ``first`` was made from the same rows
        groups, n, cost, peaks = made
        k, unit = len(groups), chunks

        def point(units: tuple[int, ...]) -> Point:
            times = [float(cost[i][u - 1]) for i, u in enumerate(units)]
            split = tuple(u * unit for u in units)
            flags = tuple(
                self._stage_cost(g, l, i == 0, i == k - 1, rows, peaks[i], others)[1]
                for i, (g, l) in enumerate(zip(groups, split))
            )
            return Point(split, flags, max(times), math.fsum(times))

        head = point(tuple(l // unit for l in first[0]))
        head = head._replace(split=first[0], flags=first[1], slowest=first[2])
        if k == 1:
            return (head,)
        least = self._least_sums(cost, n, np.asarray([INF]))[0]
        hi = point(least).slowest if least is not None else INF
        if least is not None and point(least).total >= head.total * (1 - 1e-12):
            return (head,)  # the min-max split has the least sum too
        values = np.unique(np.concatenate(cost))
        values = values[(values > head.slowest) & (values <= hi)]
        if len(values) > MAX_BOUNDS:
            values = values[np.linspace(0, len(values) - 1, MAX_BOUNDS).round().astype(int)]
        front = [head]
        for units in self._least_sums(cost, n, np.concatenate(([head.slowest], values))):
            if units is None:
                continue
            p = point(units)
            if p.total < front[-1].total * (1 - 1e-12):
                front.append(p)
        return tuple(front)

    def _least_sums(self, cost: list[np.ndarray], n: int, bounds: np.ndarray) -> list[tuple[int, ...] | None]:
        """Per bound M of ``bounds``, the units per stage of the split of least sum whose stages all take at most M
        (None: none), by a DP from the last stage back, for every bound and every r at once (best[b, r]: least
        sum of stages i.. holding r units under bound b; the first u of the least, as ``_split_layers``)."""
        k, top_units = len(cost), n - len(cost) + 1
        index = self._index(n, top_units)
        under = [np.where(c[None, :] <= bounds[:, None], c[None, :], INF) for c in cost]  # [bound, u - 1]
        padded = np.full((len(bounds), top_units + n + 1), INF)
        best = padded[:, top_units:]
        best[:, 1 : top_units + 1] = under[k - 1]
        choice = []
        for i in range(k - 2, -1, -1):
            both = under[i][:, None, :] + padded[:, index]  # [bound, r, u - 1]
            pick = both.argmin(axis=2)
            best[:] = np.take_along_axis(both, pick[..., None], axis=2)[..., 0]
            choice.append(pick + 1)
        out: list[tuple[int, ...] | None] = []
        for b in range(len(bounds)):
            if not best[b, n] < INF:
                out.append(None)
                continue
            units, r = [], n
            for pick in reversed(choice):
                units.append(int(pick[b, r]))
                r -= units[-1]
            units.append(r)
            out.append(tuple(units))
        return out

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
