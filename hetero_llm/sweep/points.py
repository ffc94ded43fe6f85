"""A sweep's points: the grid of its axes (zipped axes together, conditional axes where their condition holds),
or N of them drawn with a seed; each point is the ``--set`` items that make its layout from the base."""

from __future__ import annotations

import itertools
import random
from typing import Any

import attrs

from hetero_llm.errors import LayoutError
from hetero_llm.layout.writer import toml_value
from hetero_llm.sweep.spec import Axis, Spec


@attrs.frozen
class Point:
    index: int  # its place in the sweep (the grid's order, or the draw's)
    values: tuple[tuple[str, Any], ...]  # (axis name, the value it takes here)
    sets: tuple[str, ...]  # sweep.set, then each axis' --set items

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.values)


def points(spec: Spec) -> list[Point]:
    """Every point of the sweep, in order, without repeats (a conditional axis held at its first value where its
    condition fails makes the points it would have multiplied one)."""
    axes = spec.axes
    groups = _groups(axes)
    rng = random.Random(spec.sweep.seed)
    n = spec.sweep.random
    if any(a.continuous for a in axes):
        chosen = [_draw(axes, groups, rng) for _ in range(n)]
    else:
        grid = [_combine(axes, groups, combo) for combo in itertools.product(*(range(size) for _, size in groups))]
        chosen = rng.sample(grid, min(n, len(grid))) if n else grid
    out: list[Point] = []
    seen: set[tuple] = set()
    for values in chosen:
        values = _conditioned(axes, values)
        if values in seen:
            continue
        seen.add(values)
        sets = list(spec.sweep.set)
        for axis, (_, v) in zip(axes, values):
            sets += [f"{axis.key}={toml_value(v)}"] if axis.continuous else list(axis.sets[axis.labels.index(v)])
        out.append(Point(len(out), values, tuple(sets)))
    return out


def _groups(axes: tuple[Axis, ...]) -> list[tuple[tuple[int, ...], int]]:
    """The grid's dimensions: (axes varying together, their number of values); continuous axes are drawn apart."""
    groups: dict[str, list[int]] = {}
    for i, a in enumerate(axes):
        if not a.continuous:
            groups.setdefault(a.zip or f"\0{i}", []).append(i)
    return [(tuple(members), len(axes[members[0]].labels)) for members in groups.values()]


def _combine(axes: tuple[Axis, ...], groups, combo: tuple[int, ...]) -> tuple[tuple[str, Any], ...]:
    picked: dict[int, Any] = {}
    for (members, _), choice in zip(groups, combo):
        for i in members:
            picked[i] = axes[i].labels[choice]
    return tuple((a.name, picked[i]) for i, a in enumerate(axes) if not a.continuous)


def _draw(axes: tuple[Axis, ...], groups, rng: random.Random) -> tuple[tuple[str, Any], ...]:
    values = dict(_combine(axes, groups, tuple(rng.randrange(size) for _, size in groups)) if groups else ())
    for a in axes:
        if a.continuous:
            x = rng.uniform(a.low, a.high) if not a.log else a.low * (a.high / a.low) ** rng.random()
            values[a.name] = float(f"{x:.4g}")
    return tuple((a.name, values[a.name]) for a in axes)


def _conditioned(axes: tuple[Axis, ...], values: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """Each axis whose ``when`` fails at this point held at its first value (a continuous one at its low end)."""
    by_name = dict(values)
    for a in axes:
        if a.when and not all(by_name[other] in labels for other, labels in a.when):
            by_name[a.name] = a.labels[0] if a.labels else a.low
    return tuple((a.name, by_name[a.name]) for a in axes)


def shard(all_points: list[Point], spec: str, file: str) -> list[Point]:
    """``--shard I/N``: the points whose index is I modulo N (I from 0: a SLURM array's task id)."""
    i, _, n = spec.partition("/")
    if not (i.isdigit() and n.isdigit() and int(n) >= 1 and int(i) < int(n)):
        raise LayoutError(file, "--shard", f"expected I/N with 0 <= I < N (e.g. 0/4), got '{spec}'")
    return [p for p in all_points if p.index % int(n) == int(i)]
