"""A sweep file (``hetero-sweep SPEC.toml``): its ``[sweep]`` table and ``[[axes]]``, read strictly.

Only this module touches the spec's TOML dict: unknown keys are errors with a did-you-mean, every value is
checked where it is read, and each problem is one ``LayoutError`` naming the file, the TOML path and the fix.
"""

from __future__ import annotations

import enum
import math
from pathlib import Path
from typing import Any

import attrs

from hetero_llm.errors import LayoutError
from hetero_llm.layout import build
from hetero_llm.layout import reader as layout_reader
from hetero_llm.layout.fields import Check, check_own
from hetero_llm.layout.fields import key as _key
from hetero_llm.layout.writer import toml_value


class Mode(str, enum.Enum):
    PREDICT = "predict"  # the cost model only: no process starts
    RUN = "run"  # every point trained, measured
    BOTH = "both"  # predicted, then trained and measured


class Invalid(str, enum.Enum):
    SKIP = "skip"  # an invalid point is listed with its reason and skipped
    REFUSE = "refuse"  # any invalid point stops the sweep before anything runs


# what a sweep sorts by, and whether smaller is better
METRICS = {"step_time": True, "tokens_per_s": False, "loss": True, "valid_loss": True, "peak_memory": True}


@attrs.frozen
class SweepTable:
    """``[sweep]``: what is swept and how."""

    layout: str = _key(
        "the base layout file (relative to the sweep file); a cluster file (no [[pipelines]]) is planned first "
        "(hetero-plan) and its best layout is the base"
    )
    cluster: str = _key(
        "a planner cluster file whose device kinds and network the predictions use (relative to the spec); "
        "'' = the layout's own CPU nodes",
        default="",
    )
    mode: Mode = _key("'predict' (the cost model only), 'run' (train every point) or 'both'", default=Mode.BOTH)
    metric: str = _key(
        "what the report sorts by: step_time, tokens_per_s, loss, valid_loss or peak_memory (measured where the "
        "point ran, else predicted)",
        check=Check(lambda v: v in METRICS, f"unknown metric {{v!r}} (one of {', '.join(METRICS)})"),
        default="tokens_per_s",
    )
    set: tuple[str, ...] = _key("--set overrides every point takes (e.g. 'train.steps=10')", default=())
    invalid: Invalid = _key(
        "'skip' invalid points (listed with their reason) or 'refuse' the sweep", default=Invalid.SKIP
    )
    timeout_s: float = _key(
        "seconds a run point may take before its processes are stopped (recorded as a timeout)",
        check=Check(lambda v: v > 0, "must be > 0 seconds, got {v:g}"),
        default=600.0,
    )
    random: int = _key(
        "0 = every point of the grid; N = N points drawn with seed (needed with uniform / log_uniform axes)",
        check=Check(lambda v: v >= 0, "must be >= 0, got {v}"),
        default=0,
    )
    seed: int = _key("the seed of the random draw", default=0)
    record: tuple[str, ...] = _key(
        "what a run point keeps in its folder besides its metrics: 'checkpoint' (the final save), 'trace'",
        check=Check(lambda v: set(v) <= {"checkpoint", "trace"}, "only 'checkpoint' and 'trace' can be recorded"),
        default=(),
    )


@attrs.frozen
class Axis:
    """One ``[[axes]]`` table: a name and the values it takes, each a list of ``--set`` items."""

    name: str
    labels: tuple[Any, ...]  # the value shown and recorded for each choice (empty for a continuous axis)
    sets: tuple[tuple[str, ...], ...]  # the --set items of each choice
    key: str = ""  # the layout key a values= axis or a continuous axis sets
    zip: str = ""  # axes with the same zip name vary together
    when: tuple[tuple[str, tuple[Any, ...]], ...] = ()  # (axis, labels): varied only where those axes take those
    low: float = 0.0  # uniform / log_uniform: the range drawn from
    high: float = 0.0
    log: bool = False

    @property
    def continuous(self) -> bool:
        return not self.labels


@attrs.frozen
class Spec:
    file: str
    base: Path  # the base layout file
    cluster: Path | None
    sweep: SweepTable
    axes: tuple[Axis, ...]


AXIS_KEYS = ["name", "key", "values", "sets", "zip", "when", "uniform", "log_uniform"]


def read_spec(path: str | Path) -> Spec:
    """The sweep file at ``path``, every key checked."""
    file = str(path)
    raw = layout_reader.read(path)
    layout_reader.check_keys(raw, ["sweep", "axes"], "", file, what="section")
    if "sweep" not in raw:
        raise LayoutError(file, "sweep", "missing section (add [sweep] with layout = 'your-layout.toml')")
    table = build(SweepTable, raw["sweep"], "sweep", file)
    check_own(file, table, "sweep", *(f.name for f in attrs.fields(SweepTable)))
    folder = Path(path).parent
    base = folder / table.layout
    if not base.is_file():
        raise LayoutError(file, "sweep.layout", f"no such file '{base}' (paths are relative to the sweep file)")
    cluster = folder / table.cluster if table.cluster else None
    if cluster is not None and not cluster.is_file():
        raise LayoutError(file, "sweep.cluster", f"no such file '{cluster}' (paths are relative to the sweep file)")
    axes_raw = raw.get("axes", [])
    if not isinstance(axes_raw, list) or not all(isinstance(t, dict) for t in axes_raw):
        raise LayoutError(file, "axes", "expected [[axes]] tables")
    axes = tuple(_axis(t, f"axes[{i}]", file) for i, t in enumerate(axes_raw))
    _check_axes(axes, table, file)
    return Spec(file, base, cluster, table, axes)


def _axis(t: dict, where: str, file: str) -> Axis:
    layout_reader.check_keys(t, AXIS_KEYS, where, file)
    name = t.get("name", t.get("key"))
    if not isinstance(name, str) or not name:
        raise LayoutError(file, f"{where}.name", "missing: name the axis (or give its layout key, key = 'train.lr')")
    key = t.get("key", "")
    if not isinstance(key, str):
        raise LayoutError(file, f"{where}.key", "expected a string (a --set key, e.g. 'pipelines[0].microbatches')")
    zip_name = t.get("zip", "")
    if not isinstance(zip_name, str):
        raise LayoutError(file, f"{where}.zip", "expected a string (axes with the same zip name vary together)")
    when = _when(t.get("when", {}), f"{where}.when", file)
    given = [k for k in ("values", "uniform", "log_uniform") if k in t]
    if len(given) != 1:
        raise LayoutError(file, where, "give exactly one of values = [...], uniform = [low, high], log_uniform = [...]")
    if given[0] != "values":
        return _continuous(t, given[0], name, key, zip_name, when, where, file)
    values = t["values"]
    if not isinstance(values, list) or not values:
        raise LayoutError(file, f"{where}.values", "expected a non-empty array of the values the axis takes")
    if "sets" in t:
        sets = t["sets"]
        if (
            not isinstance(sets, list)
            or len(sets) != len(values)
            or not all(isinstance(s, list) and all(isinstance(x, str) for x in s) for s in sets)
        ):
            raise LayoutError(
                file, f"{where}.sets", f"expected {len(values)} arrays of --set strings, one per value (KEY=VALUE)"
            )
        choices = tuple(tuple(s) for s in sets)
    elif key:
        choices = tuple((f"{key}={toml_value(v)}",) for v in values)
    else:
        raise LayoutError(file, where, "say what each value sets: key = 'train.schedule' or sets = [[...], ...]")
    return Axis(name, tuple(values), choices, key, zip_name, when)


def _continuous(t: dict, kind: str, name: str, key: str, zip_name: str, when, where: str, file: str) -> Axis:
    bounds = t[kind]
    ok = isinstance(bounds, list) and len(bounds) == 2 and all(isinstance(b, int | float) for b in bounds)
    if not ok or not (math.isfinite(bounds[0]) and bounds[0] < bounds[1]):
        raise LayoutError(file, f"{where}.{kind}", "expected [low, high], two finite numbers with low < high")
    if kind == "log_uniform" and bounds[0] <= 0:
        raise LayoutError(file, f"{where}.{kind}", f"low must be > 0 for a log scale, got {bounds[0]}")
    if not key or zip_name:
        raise LayoutError(file, where, f"a {kind} axis needs key = '...' and is drawn alone (no zip)")
    return Axis(name, (), (), key, "", when, float(bounds[0]), float(bounds[1]), kind == "log_uniform")


def _when(value: Any, where: str, file: str) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    if not isinstance(value, dict) or not all(isinstance(v, list) and v for v in value.values()):
        raise LayoutError(
            file, where, "expected a table of axis name = [values it must take], e.g. {schedule = ['1f1b']}"
        )
    return tuple((k, tuple(v)) for k, v in value.items())


def _check_axes(axes: tuple[Axis, ...], table: SweepTable, file: str) -> None:
    names = [a.name for a in axes]
    for i, a in enumerate(axes):
        if a.name in names[:i]:
            raise LayoutError(file, f"axes[{i}].name", f"'{a.name}' names two axes (give each its own name)")
        for other, labels in a.when:
            if other not in names or other == a.name:
                raise LayoutError(file, f"axes[{i}].when.{other}", f"not another axis (axes: {', '.join(names)})")
            if axes[names.index(other)].continuous:
                raise LayoutError(file, f"axes[{i}].when.{other}", "a continuous axis cannot be a condition")
            unknown = [v for v in labels if v not in axes[names.index(other)].labels]
            if unknown:
                raise LayoutError(file, f"axes[{i}].when.{other}", f"{unknown[0]!r} is not one of that axis' values")
        if a.continuous and table.random == 0:
            raise LayoutError(file, f"axes[{i}]", "a continuous axis is drawn: set sweep.random = N points")
    zipped: dict[str, int] = {}
    for i, a in enumerate(axes):
        if a.zip and zipped.setdefault(a.zip, len(a.labels)) != len(a.labels):
            raise LayoutError(
                file,
                f"axes[{i}].values",
                f"zip '{a.zip}': {len(a.labels)} values, but its other axes have {zipped[a.zip]}",
            )
