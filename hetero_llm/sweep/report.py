"""A sweep's report: the points as a table sorted by the chosen metric, the best one written out as a layout file,
predicted against measured (mean error, Kendall tau), and plots (the ``plot`` extra: matplotlib)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hetero_llm.sweep.results import field
from hetero_llm.sweep.spec import METRICS

# the record's figure for each metric: measured where the point ran, else predicted
SOURCES = {
    "step_time": ("measured.step_time_s", "predicted.step_time_s"),
    "tokens_per_s": ("measured.tokens_per_s", "predicted.tokens_per_s"),
    "loss": ("measured.final_loss", None),
    "valid_loss": ("measured.valid_loss", None),
    "peak_memory": ("measured.peak_rss_gb", "predicted.peak_memory_gb"),
}


def metric_of(record: dict[str, Any], metric: str) -> float | None:
    measured, predicted = SOURCES[metric]
    value = field(record, measured)
    if value is None and predicted is not None:
        value = field(record, predicted)
    return value if isinstance(value, int | float) and math.isfinite(value) else None


def ranked(records: Sequence[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """The points with a value of ``metric``, best first (ties: the earlier point)."""
    sign = 1.0 if METRICS[metric] else -1.0
    scored = [r for r in records if metric_of(r, metric) is not None and r["status"] in ("ok", "predicted")]
    return sorted(scored, key=lambda r: (sign * (metric_of(r, metric) or 0.0), r["point"]))


def kendall_tau(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Kendall's tau-b of two equally long sequences (None for fewer than 2 pairs or no order in one of them)."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    n_x = concordant + discordant + ties_y  # pairs ordered in x
    n_y = concordant + discordant + ties_x
    return (concordant - discordant) / math.sqrt(n_x * n_y) if n_x and n_y else None


def accuracy(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Predicted against measured step time over the points that have both: mean |error| and Kendall tau."""
    pairs = [
        (field(r, "predicted.step_time_s"), field(r, "measured.step_time_s"))
        for r in records
        if r["status"] == "ok"
        and field(r, "predicted.step_time_s") is not None
        and field(r, "measured.step_time_s") is not None
    ]
    if not pairs:
        return {"points": 0, "mean_error": None, "kendall_tau": None}
    errors = [abs(p - m) / m for p, m in pairs]
    return {
        "points": len(pairs),
        "mean_error": sum(errors) / len(errors),
        "kendall_tau": kendall_tau([p for p, _ in pairs], [m for _, m in pairs]),
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(records: Sequence[dict[str, Any]], metric: str) -> str:
    """Markdown: every point, the ranked ones first by ``metric``, then the rest (invalid, failed) with why."""
    axes = list(dict.fromkeys(k for r in records for k in r["axes"]))
    best = ranked(records, metric)
    rest = [r for r in records if r not in best]
    heads = [
        "point",
        *axes,
        "status",
        "pred step s",
        "step s",
        "step p90 s",
        "pred tokens/s",
        "tokens/s",
        "pred mem GB",
        "rss GB",
        "loss",
        "valid",
    ]
    lines = ["| " + " | ".join(heads) + " |", "|" + " --- |" * len(heads)]
    for r in best + rest:
        cells = [r["point"], *(r["axes"].get(a) for a in axes), r["status"]]
        cells += [field(r, f) for f in FIGURES]
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    why = [f"- point {r['point']} ({r['status']}): {r['error']}" for r in rest if r.get("error")]
    return "\n".join(lines + ([""] + why if why else [])) + "\n"


FIGURES = [
    "predicted.step_time_s",
    "measured.step_time_s",
    "measured.step_time_p90_s",
    "predicted.tokens_per_s",
    "measured.tokens_per_s",
    "predicted.peak_memory_gb",
    "measured.peak_rss_gb",
    "measured.final_loss",
    "measured.valid_loss",
]


def plots(folder: Path, records: Sequence[dict[str, Any]], metric: str, say: Callable[[str], None]) -> list[Path]:
    """``METRIC_vs_AXIS.png`` for each axis with numbers or words, and ``predicted_vs_measured.png`` when points ran;
    without matplotlib (pip install 'hetero_llm[plot]'), a note and none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("plots: skipped (needs matplotlib: pip install 'hetero_llm[plot]')")
        return []
    written = []
    scored = [r for r in records if metric_of(r, metric) is not None and r["status"] in ("ok", "predicted")]
    for axis in dict.fromkeys(k for r in scored for k in r["axes"]):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        xs = [str(r["axes"][axis]) for r in scored]
        order = list(dict.fromkeys(sorted(xs, key=_natural)))
        ax.scatter([order.index(x) for x in xs], [metric_of(r, metric) or 0.0 for r in scored], alpha=0.7)
        ax.set_xticks(range(len(order)), order, rotation=30 if len(order) > 6 else 0)
        ax.set_xlabel(axis)
        ax.set_ylabel(metric)
        written.append(_save(fig, plt, folder / f"{metric}_vs_{_safe(axis)}.png"))
    pairs = [r for r in records if r["status"] == "ok" and field(r, "predicted.step_time_s") is not None]
    if pairs:
        fig, ax = plt.subplots(figsize=(4.5, 4.5))
        xs = [field(r, "predicted.step_time_s") for r in pairs]
        ys = [field(r, "measured.step_time_s") for r in pairs]
        ax.scatter(xs, ys)
        for r, x, y in zip(pairs, xs, ys):
            ax.annotate(str(r["point"]), (x, y), fontsize=7)
        ax.set_xlabel("predicted step time (s)")
        ax.set_ylabel("measured step time, median (s)")
        written.append(_save(fig, plt, folder / "predicted_vs_measured.png"))
    return written


def _natural(text: str) -> tuple:
    try:
        return (0, float(text), text)
    except ValueError:
        return (1, 0.0, text)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def _save(fig, plt, path: Path) -> Path:
    from hetero_llm._fs import write_atomically

    fig.tight_layout()
    write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return path
