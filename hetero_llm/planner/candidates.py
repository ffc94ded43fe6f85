"""A candidate layout as the planner's search builds and scores it: TP groups, stages, pipelines, the
schedule, and what the cost model predicts for it (``Score``). Torch-free."""

from __future__ import annotations

import math
import operator

import attrs

from hetero_llm.planner.cluster import DeviceKind


@attrs.frozen(cache_hash=True)  # a dict key in every memo of the search
class TPGroup:
    """A stage's devices, of one node: a TP group, or with context parallelism ``cp`` TP groups of
    ``len(devices) / cp`` devices each holding ``1 / cp`` of every sequence's tokens (the layout's
    ``[[pipelines.stages]] cp``: devices CP-major, CP rank ``r``'s TP group devices ``r tp .. r tp + tp - 1``)."""

    node: str
    domain: str
    devices: tuple[str, ...]
    kind: DeviceKind
    cp: int = 1
    overlap: bool = True  # the ring's transfers overlap the attention blocks (the layout's cp_overlap)

    @property
    def tp(self) -> int:
        return len(self.devices) // self.cp

    @property
    def flops(self) -> float:
        """FLOP/s of the whole stage (TP x CP devices)."""
        return len(self.devices) * self.kind.tflops * 1e12

    @property
    def name(self) -> tuple:
        """What names the group inside one cluster: its devices, and its CP size (the same devices split
        otherwise are another group)."""
        return (self.devices, self.cp)


@attrs.frozen
class StageChoice:
    group: TPGroup
    layers: int
    recompute: bool = False


@attrs.frozen
class PipelineChoice:
    batch: int
    microbatches: int
    stages: tuple[StageChoice, ...]

    @property
    def rows(self) -> int:
        return self.batch // self.microbatches


@attrs.frozen
class Candidate:
    pipelines: tuple[PipelineChoice, ...]
    schedule: str = "1f1b"
    chunks: int = 1
    optimizer: str = ""  # train.optimizer of the plan ('' = the cluster file's)

    def key(self) -> tuple:
        return (
            self.schedule,
            self.chunks,
            self.optimizer,
            tuple(
                (p.batch, p.microbatches, tuple((s.group.devices, s.layers, s.recompute, s.group.cp) for s in p.stages))
                for p in self.pipelines
            ),
        )

    def shape(self) -> tuple:
        """The plan up to which of interchangeable devices (same kind, TP size and domain) it uses, whatever its
        optimizer: the ranked plans show each shape once."""
        return (
            self.schedule,
            self.chunks,
            tuple(
                sorted(
                    (
                        p.batch,
                        p.microbatches,
                        tuple(
                            (s.group.kind.name, s.group.tp, s.group.domain, s.layers, s.recompute, s.group.cp)
                            for s in p.stages
                        ),
                    )
                    for p in self.pipelines
                )
            ),
        )


@attrs.frozen
class Score:
    """What the cost model predicts for one candidate."""

    step_time: float  # seconds; inf when a stage does not fit in memory
    pipeline_times: tuple[float, ...]
    bubble: float  # idle fraction of the slowest pipeline's stages
    tp_time: float  # seconds of TP all-reduces per step on the busiest stage of the slowest pipeline
    sync_time: float
    optimizer_time: float
    memory: tuple[tuple[float, ...], ...]  # bytes per device, [pipeline][stage]
    capacity: tuple[tuple[float, ...], ...]  # usable bytes per device (after the margin)
    tokens_per_s: float
    mfu: float
    lower_bound: float  # seconds: the step's model FLOPs over every device's peak

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.step_time)

    @property
    def gap(self) -> float:
        return self.step_time / self.lower_bound - 1.0

    def worst_memory(self) -> tuple[int, int, float]:
        """(pipeline, stage, bytes over capacity) of the stage furthest over (or nearest to) its memory."""
        return max(
            (
                (p, s, m - c)
                for p, (ms, cs) in enumerate(zip(self.memory, self.capacity))
                for s, (m, c) in enumerate(zip(ms, cs))
            ),
            key=lambda x: x[2],
        )


class ByIdentity:
    """A memo keyed by objects' identities (plus hashable ``extra``), for what the search shares between
    candidates (stage tuples, candidates) and whose hash would cost more than the lookup saves. Each entry keeps
    its objects, so an id in a key stays theirs while the entry stands (no other object can take it)."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[tuple, object]] = {}

    def get(self, objs: tuple, extra: tuple = ()):
        """The value put for these very objects (and ``extra``), else None."""
        known = self._entries.get((tuple(map(id, objs)), extra))
        if known is not None and all(map(operator.is_, known[0], objs)):
            return known[1]
        return None

    def put(self, objs: tuple, value, extra: tuple = ()):
        self._entries[tuple(map(id, objs)), extra] = (objs, value)
        return value
