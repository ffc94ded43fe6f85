"""Timelines of a schedule: a PNG with one row per rank or stage, measured or simulated.

``plot_timeline`` draws rows of ``(action string, start s, end s)``: the rank files that
``hetero-launch --trace DIR`` writes (``trace.rank_rows``) or a simulation (``SimResult.rows()``).

Command line::

    python -m hetero_llm.timeline TRACE_DIR --out timeline.png --chrome trace.json
    python -m hetero_llm.timeline --simulate --stages 4 --microbatches 8 --schedule 1f1b --out sim.png

matplotlib is imported only when a PNG is drawn (``pip install hetero_llm[plot]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hetero_llm._fs import write_atomically
from hetero_llm.errors import ScheduleError
from hetero_llm.schedule import COMPUTE_KINDS, Action

__all__ = ["COLORS", "plot_timeline", "simulated"]

COLORS = {
    "F": "#4e79a7",  # forward: blue
    "B": "#59a14f",  # backward: green
    "I": "#8cd17d",  # input gradient (a split backward's first half): light green
    "W": "#b07aa1",  # weight gradient: purple
    "SEND": "#f28e2b",  # send posted / in flight: orange
    "RECV": "#9c9c9c",  # receive, waiting for data: grey
    "RS": "#e15759",  # ZeRO-1 gradient reduce-scatter in flight: red
    "AG": "#76b7b2",  # ZeRO-1 wait for the parameter all-gather: teal
    "SWITCH": "#edc948",  # hot switching: parameters and gradients re-laid out between layouts: yellow
}
_NAMES = {
    "F": "forward",
    "B": "backward",
    "I": "input grad",
    "W": "weight grad",
    "SEND": "send",
    "RECV": "recv (wait)",
    "RS": "reduce-scatter",
    "AG": "all-gather (wait)",
    "SWITCH": "switch",
}
_COMPUTE_CATEGORIES = frozenset(kind.value for kind in COMPUTE_KINDS)  # F, B, I, W

# Vertical layout of one row (y grows downwards): compute on top, then recv, then send strips.
_COMPUTE = (-0.42, 0.58)  # (offset from the row's centre, height)
_RECV = (0.18, 0.11)
_SEND = (0.30, 0.11)


def _category(action: str) -> tuple[str, int | None, int]:
    """``"SEND_F3.1"`` -> ``("SEND", 3, 1)``; unknown strings get their own category."""
    if action.startswith("SWITCH>"):  # "SWITCH>b1": a hot switch into bucket 1's layout
        return "SWITCH", None, 0
    try:
        parsed = Action.parse(action)
    except ScheduleError:
        return action, None, 0
    return parsed.kind.value.split("_")[0], parsed.mb, parsed.chunk  # SEND_F and SEND_B are both "SEND"


def _shade(color: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """Later chunks of an interleaved schedule are drawn lighter (mixed with white)."""
    rgb = tuple(int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    mix = 0.5 * chunk / max(chunks - 1, 1) if chunks > 1 else 0.0
    return tuple(c + (1 - c) * mix for c in rgb)  # type: ignore[return-value]


def plot_timeline(
    rows: Sequence[Sequence[tuple[str, float, float]]],
    path_png: str | Path,
    title: str = "",
    *,
    labels: Sequence[str] | None = None,
) -> Path:
    """Draw ``rows`` (per rank or stage: ``(action, start s, end s)``) into a PNG; returns its path.

    Compute bars fill most of a row, receives (the time spent waiting for data) and sends (until
    the data has arrived, in a simulation) are thin strips under them. Microbatch numbers
    (``mb.chunk`` for later chunks) are written in bars wide enough to hold them. Time is in ms
    from the earliest start.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:  # pragma: no cover - matplotlib is a test dependency
        raise RuntimeError("plot_timeline needs matplotlib: pip install 'hetero_llm[plot]'") from None

    labels = list(labels) if labels is not None else [f"stage {i}" for i in range(len(rows))]
    if len(labels) != len(rows):
        raise ValueError(f"plot_timeline: {len(labels)} labels for {len(rows)} rows")
    starts = [start for row in rows for _, start, _ in row]
    ends = [end for row in rows for _, _, end in row]
    t0 = min(starts, default=0.0)
    span_ms = max((max(ends, default=0.0) - t0) * 1e3, 1e-6)
    chunks = 1 + max((_category(a)[2] for row in rows for a, _, _ in row), default=0)

    fig = Figure(
        figsize=(
            min(max(8.0, 0.12 * max(len(r) for r in rows) if rows else 8.0), 20.0),
            1.2 + 0.55 * max(len(rows), 1),
        ),
        dpi=120,
    )
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    used: set[str] = set()
    texts = []  # (x centre ms, y centre, width ms, text, colour)
    for y, row in enumerate(rows):
        for action, start, end in row:
            category, mb, chunk = _category(action)
            color = COLORS.get(category, "#333333")
            used.add(category if category in COLORS else "other")
            x, width = (start - t0) * 1e3, max(end - start, 0.0) * 1e3
            offset, height = {"SEND": _SEND, "RS": _SEND, "RECV": _RECV, "AG": _RECV}.get(category, _COMPUTE)
            ax.broken_barh(
                [(x, width)],
                (y + offset, height),
                facecolors=[_shade(color, chunk, chunks)],
                edgecolors="white" if category in _COMPUTE_CATEGORIES else "none",
                linewidth=0.4,
            )
            if category in _COMPUTE_CATEGORIES and mb is not None:
                light = chunks > 1 and chunk / (chunks - 1) > 0.5
                texts.append(
                    (
                        x + width / 2,
                        y + offset + height / 2,
                        width,
                        f"{mb}.{chunk}" if chunk else str(mb),
                        "#222222" if light else "white",
                    )
                )
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_ylim(len(rows) - 0.5, -0.6)  # row 0 on top
    ax.set_yticks(range(len(rows)), labels)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    if title:
        ax.set_title(title, fontsize=10)
    handles = [Patch(color=COLORS[c], label=_NAMES[c]) for c in COLORS if c in used]
    if "other" in used:
        handles.append(Patch(color="#333333", label="other"))
    if chunks > 1:
        handles.append(
            Patch(facecolor=_shade(COLORS["F"], chunks - 1, chunks), label=f"lighter: later chunk (of {chunks})")
        )
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))  # leave 0.35 in for the legend

    # Write microbatch numbers only where they fit: measure the axes in pixels after layout.
    axes_px = ax.get_window_extent().width
    px_per_ms = axes_px / (span_ms * 1.01)
    fontsize = 7 if len(rows) > 8 else 8
    char_px = 0.62 * fontsize * fig.dpi / 72
    for x, y_mid, width, text, color in texts:
        if width * px_per_ms >= char_px * len(text) + 3:
            ax.text(x, y_mid, text, ha="center", va="center", fontsize=fontsize, color=color)
    path = Path(path_png)
    path.parent.mkdir(parents=True, exist_ok=True)
    # through a temporary file renamed over it: never a half-written image; the format is the name's
    write_atomically(path, lambda f: fig.savefig(f, format=path.suffix.lstrip(".") or None))
    return path


# --------------------------------------------------------------------------- command line


def simulated(stages, microbatches, kind, chunks, schedule_file, forward_ms, backward_ms, weight_ms, latency_ms):
    from hetero_llm import schedule as sched
    from hetero_llm.predict.simulate import CostModel, simulate

    if schedule_file:
        actions = sched.load_schedule_file(schedule_file, stages, microbatches)
        name = Path(schedule_file).name
    else:
        chunks = chunks if chunks is not None else (2 if kind == "interleaved" else 1)
        actions = sched.build(kind, stages, microbatches, chunks=chunks)
        name = kind + (f" ({chunks} chunks)" if kind == "interleaved" else "")
    split = any(a.kind is sched.Kind.W for row in actions for a in row)
    weight = (weight_ms if weight_ms is not None else backward_ms / 2) / 1e3 if split else None
    cost = CostModel.uniform(stages, forward_ms / 1e3, backward_ms / 1e3, latency=latency_ms / 1e3, weight=weight)
    result = simulate(actions, cost)
    title = (
        f"simulated {name}: {stages} stages, {microbatches} microbatches; step "
        f"{result.step_time * 1e3:.2f} ms, bubble {result.mean_bubble:.1%}"
    )
    return [f"stage {s}" for s in range(stages)], result.rows(), title, result.summary()
