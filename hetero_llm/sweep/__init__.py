"""``hetero-sweep SPEC.toml``: a base layout and axes of ``--set`` values; every point validated and predicted
before any runs, then (mode run or both) each trained as a launch of its own; results appended one JSON line per
point, resumable, reported (table, best layout, predicted against measured, plots). Torch-free.

Modules: ``spec`` (the sweep file), ``points`` (the grid, zipped, conditional and drawn axes; shards),
``results`` (the JSON lines, CSV, merge), ``report`` (table, accuracy, plots). ``sweep`` is what the CLI calls.
"""

from __future__ import annotations

import copy
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from hetero_llm import api
from hetero_llm import layout as layout_mod
from hetero_llm.errors import LayoutError
from hetero_llm.layout import reader as layout_reader
from hetero_llm.progress import Bar
from hetero_llm.sweep import report, results
from hetero_llm.sweep.points import Point, points, shard
from hetero_llm.sweep.spec import Mode, Spec, read_spec

SHOWN = 20  # points the console's table shows (report.md has every one)

__all__ = ["Checked", "Spec", "Summary", "check_points", "merge", "read_spec", "sweep", "version"]


def version() -> str:
    """hetero_llm's version, with the source tree's git commit when it is a checkout (what a resumed sweep must
    match to count a point done)."""
    folder = Path(api.__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    from hetero_llm import __version__

    return f"{__version__}+g{commit}" if commit else __version__


@attrs.frozen
class Checked:
    """One point validated and predicted: its layout (None when invalid, ``error`` says why)."""

    point: Point
    layout: layout_mod.Layout | None
    hash: str | None
    error: str = ""
    prediction: api.Prediction | None = None
    predict_error: str = ""  # a valid layout the cost model cannot price (e.g. schedule 'dynamic')

    def predicted(self) -> dict[str, Any] | None:
        p = self.prediction
        if p is None:
            return None
        return {
            "fits": p.fits,
            "step_time_s": p.step_time_s if p.fits else None,
            "tokens_per_s": p.tokens_per_s if p.fits else None,
            "peak_memory_gb": max(p.memory_gb),
            "memory_gb": list(p.memory_gb),
        }


class _Base:
    """The base layout's TOML, read once; a point's layout is a copy of it with the point's --set items."""

    def __init__(self, path: Path):
        self.path, self.file = path, str(path)
        self.raw = layout_reader.read(path)

    def layout(self, sets: tuple[str, ...]) -> layout_mod.Layout:
        raw = copy.deepcopy(self.raw)
        for item in sets:
            layout_reader.apply_override(raw, item, self.file)
        return layout_mod.from_dict(raw, self.file, self.path.parent)


def check_points(base: _Base, pts: list[Point], cluster: Any) -> list[Checked]:
    """Each point's layout loaded, validated and predicted; a point equal to an earlier one is invalid (a repeat)."""
    out: list[Checked] = []
    seen: dict[str, int] = {}
    for pt in pts:
        try:
            lay = base.layout(pt.sets)
        except LayoutError as e:
            out.append(Checked(pt, None, None, str(e)))
            continue
        h = api.layout_hash(lay)
        if h in seen:
            out.append(Checked(pt, None, h, f"the same layout as point {seen[h]} (its axes change nothing here)"))
            continue
        seen[h] = pt.index
        try:
            out.append(Checked(pt, lay, h, prediction=api.evaluate(lay, cluster)))
        except LayoutError as e:
            out.append(Checked(pt, lay, h, predict_error=str(e)))
    return out


@attrs.frozen
class Summary:
    spec: Spec
    checked: tuple[Checked, ...]
    records: tuple[dict[str, Any], ...]  # this sweep's points' records (every run so far), in point order
    ran: int  # points run (or predicted) by this call
    skipped: int  # points a previous call completed
    best: Path | None  # the best point's layout file


def sweep(
    spec_file: str | Path,
    out: str | Path,
    *,
    shard_spec: str | None = None,
    dry_run: bool = False,
    retry_failed: bool = False,
    say: Callable[[str], None] = print,
    progress: bool | None = None,
) -> Summary:
    """Run the sweep ``spec_file`` describes into the folder ``out`` (results.jsonl, results.csv, report.md, best
    layout, plots, one folder per run point). ``shard_spec`` "I/N": only the points whose index is I mod N.
    ``dry_run``: the points and their predictions only. Points a previous call completed (same resolved layout,
    same code version, same mode) are not redone; ``retry_failed``: failed and timed-out ones are."""
    spec = read_spec(spec_file)
    out = Path(out)
    pts = points(spec)
    if shard_spec is not None:
        pts = shard(pts, shard_spec, str(spec_file))
    base_path, cluster = _base(spec, out, say)
    base = _Base(base_path)
    checked = check_points(base, pts, cluster)
    bad = [c for c in checked if c.layout is None]
    for c in bad:
        say(f"invalid: point {c.point.index} ({c.point.label()}): {c.error}")
    if bad and spec.sweep.invalid.value == "refuse":
        first = bad[0]
        raise LayoutError(
            spec.file,
            "sweep.invalid",
            f"{len(bad)} of {len(checked)} points are invalid (first: point {first.point.index}: {first.error}); "
            "fix the axes or set invalid = 'skip'",
        )
    if dry_run:
        for c in checked:
            say(_predicted_line(c))
        return Summary(spec, tuple(checked), (), 0, 0, None)
    out.mkdir(parents=True, exist_ok=True)
    ver, mode = version(), spec.sweep.mode.value
    path = out / results.RESULTS
    earlier = results.latest(results.read(path))
    redo = ("failed", "timeout") if retry_failed else ()
    done = {results.key(r) for r in earlier if r["status"] in results.DONE and r["status"] not in redo}
    todo = [c for c in checked if (c.hash or "sets:" + "\0".join(c.point.sets), ver, mode) not in done]
    todo_keys = {id(c) for c in todo}
    runs = [c for c in todo if c.layout is not None and spec.sweep.mode is not Mode.PREDICT]
    if len(checked) > len(todo):
        say(f"resuming: {len(checked) - len(todo)} of {len(checked)} points done before, {len(todo)} to do")
    with Bar("sweep", len(runs) or len(todo), "points", enabled=progress) as bar:
        for c in checked:
            if id(c) not in todo_keys:
                continue
            record = _record(c, ver, mode)
            if c.layout is not None and spec.sweep.mode is not Mode.PREDICT:
                record |= _run(spec, base_path, out, c)
                bar.update(1, note=f"point {c.point.index}: {record['status']}")
                say(_run_line(c, record))
            elif spec.sweep.mode is Mode.PREDICT:
                bar.update(1)
            results.append(path, record)
    mine = {(c.hash or "sets:" + "\0".join(c.point.sets), ver, mode) for c in checked}
    records = [r for r in results.latest(results.read(path)) if results.key(r) in mine]
    best = write_report(spec, base, out, records, say)
    return Summary(spec, tuple(checked), tuple(records), len(todo), len(checked) - len(todo), best)


def _base(spec: Spec, out: Path, say: Callable[[str], None]) -> tuple[Path, Any]:
    """The base layout file and the cluster the predictions use; a cluster file as the base is planned first
    (its best layout written to OUT/base.toml) and prices the points."""
    raw = layout_reader.read(spec.base)
    cluster = api.load_cluster(spec.cluster) if spec.cluster is not None else None
    if "pipelines" in raw:
        return spec.base, cluster
    out.mkdir(parents=True, exist_ok=True)
    planned = api.plan_cluster(spec.base, out / "base.toml")
    say(f"planned {spec.base}: {planned.result.score.step_time:.4g} s per step predicted; wrote {out / 'base.toml'}")
    return out / "base.toml", cluster if cluster is not None else planned.cluster


def _record(c: Checked, ver: str, mode: str) -> dict[str, Any]:
    return {
        "point": c.point.index,
        "axes": dict(c.point.values),
        "sets": list(c.point.sets),
        "hash": c.hash if c.layout is not None else None,
        "version": ver,
        "mode": mode,
        "status": "invalid" if c.layout is None else "predicted" if c.prediction is not None else "unpriced",
        "error": c.error or c.predict_error,
        "exit_code": None,
        "predicted": c.predicted(),
        "measured": None,
    }


def _run(spec: Spec, base_path: Path, out: Path, c: Checked) -> dict[str, Any]:
    """One run point: its own launch, port and folder (OUT/points/INDEX-HASH); its failure recorded, not raised."""
    assert c.layout is not None and c.hash is not None
    work = out / "points" / f"{c.point.index:04d}-{c.hash}"
    work.mkdir(parents=True, exist_ok=True)
    layout_mod.dump(c.layout, work / "layout.toml", relative_to=work)  # what ran, for people
    args: list[str] = []
    if "checkpoint" in spec.sweep.record:
        args += ["--checkpoint", str(work / "checkpoint")]
    if "trace" in spec.sweep.record:
        args += ["--trace", str(work / "trace")]
    r = api.run(base_path, work, c.point.sets, timeout_s=spec.sweep.timeout_s, args=args)
    measured = {
        "step_time_s": r.step_time_s,
        "step_time_p90_s": r.step_time_p90_s,
        "tokens_per_s": r.tokens_per_s,
        "peak_rss_gb": r.peak_rss_gb,
        "final_loss": r.final_loss,
        "valid_loss": r.valid_loss,
        "steps": len(r.steps),
        "wall_s": r.wall_s,
    }
    error = r.error or c.predict_error
    return {"status": r.status, "exit_code": r.exit_code, "error": error, "measured": measured, "folder": str(work)}


def _predicted_line(c: Checked) -> str:
    head = f"point {c.point.index:>4}  {c.point.label()}"
    if c.layout is None:
        return f"{head}  invalid: {c.error}"
    p = c.predicted()
    if p is None:
        return f"{head}  not predicted: {c.predict_error}"
    if not p["fits"]:
        return f"{head}  predicted: does not fit ({p['peak_memory_gb']:.3g} GB peak)"
    return (
        f"{head}  predicted {p['step_time_s']:.4g} s/step, {p['tokens_per_s']:.4g} tokens/s, "
        f"{p['peak_memory_gb']:.3g} GB peak"
    )


def _run_line(c: Checked, record: dict[str, Any]) -> str:
    m, p = record["measured"], record["predicted"] or {}
    head = f"point {c.point.index:>4}  {c.point.label()}  {record['status']}"
    if record["status"] != "ok":
        return f"{head}: {record['error']}"
    pred = f" (predicted {p['step_time_s']:.4g})" if p.get("step_time_s") else ""
    return f"{head}: {m['step_time_s']:.4g} s/step{pred}, loss {m['final_loss']:.4f}"


def write_report(
    spec: Spec, base: _Base, out: Path, records: list[dict[str, Any]], say: Callable[[str], None]
) -> Path | None:
    """results.csv, report.md (table, predicted against measured), best.toml and the plots, into ``out``."""
    from hetero_llm._fs import write_atomically

    results.write_csv(out / results.CSV, records)
    metric = spec.sweep.metric
    ranked = report.ranked(records, metric)
    acc = report.accuracy(records)
    lines = [f"# Sweep {spec.file}: {len(records)} points, sorted by {metric}", "", report.table(records, metric)]
    if acc["points"]:
        tau = acc["kendall_tau"]
        lines.append(
            f"Predicted against measured step time over {acc['points']} points: mean |error| "
            f"{acc['mean_error']:.1%}, Kendall tau {'-' if tau is None else f'{tau:.2f}'}.\n"
        )
    best = None
    if ranked:
        best = out / "best.toml"
        lay = base.layout(tuple(ranked[0]["sets"]))
        layout_mod.dump(
            lay,
            best,
            header=f"The best point ({metric}) of the sweep {spec.file}: point {ranked[0]['point']}, "
            f"{' '.join(f'{k}={v}' for k, v in ranked[0]['axes'].items())}\n",
            relative_to=out,
        )
        lines.append(f"Best by {metric}: point {ranked[0]['point']}, written to {best}.\n")
    text = "\n".join(lines)
    write_atomically(out / "report.md", lambda f: f.write(text.encode()))
    report.plots(out, records, metric, say)
    shown = report.table(records, metric).splitlines()
    if len(shown) > SHOWN + 2:  # the console shows the best points; report.md has them all
        shown = shown[: SHOWN + 2] + [f"... {len(records) - SHOWN} more points in {out / 'report.md'}"]
    say("\n".join([lines[0], "", *shown, "", *lines[3:]]).rstrip())
    return best


def merge(
    spec_file: str | Path, out: str | Path, slices: list[Path], say: Callable[[str], None] = print
) -> Path | None:
    """``hetero-sweep merge SPEC OUT SLICE...``: the slices' results joined into ``out``, then the sweep's report."""
    spec = read_spec(spec_file)
    out = Path(out)
    joined = results.merge(out, slices)
    base_path = spec.base if "pipelines" in layout_reader.read(spec.base) else slices[0] / "base.toml"
    return write_report(spec, _Base(base_path), out, joined, say)
