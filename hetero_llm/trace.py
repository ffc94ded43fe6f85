"""Per-action timing records (``--trace DIR``) and their merge into a Chrome/Perfetto trace.

Each rank writes ``rank{R}.json``: ``{"rank", "pipeline", "stage", "device", "events": [{"action",
"start", "end"}, ...]}`` with times in seconds of ``time.perf_counter()`` (one clock per host, so
ranks of one host line up; ranks on different hosts are shifted by their clocks' offset). The
events of every step follow one another in the file; ``split_steps`` cuts them into steps.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # reading traces needs no plan (nor the layout it imports)
    from hetero_llm.plan import Plan

Row = list[tuple[str, float, float]]
"""One rank's or stage's ``(action string, start s, end s)`` records."""

_KIND_RE = re.compile(r"[A-Z_]+")


def write_rank_trace(directory: str, plan: Plan, rank: int, events: list[tuple[str, float, float]]) -> None:
    """Write ``rank{R}.json``: this rank's (action, start, end) records, atomically."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    info = plan.ranks[rank]
    record = {"rank": rank, "pipeline": info.pipeline, "stage": info.stage, "device": info.device_id,
              "events": [{"action": a, "start": s, "end": e} for a, s, e in events]}
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / f"rank{rank}.json")


def read_rank_traces(directory: str | Path) -> list[dict]:
    """Every ``rank*.json`` record in ``directory``, ordered by rank."""
    paths = list(Path(directory).glob("rank*.json"))
    if not paths:
        raise FileNotFoundError(f"{directory}: no rank*.json trace files (run with --trace {directory})")
    records = []
    for path in paths:
        try:
            record = json.loads(path.read_text())
        except ValueError as error:
            raise ValueError(f"{path}: not JSON ({error})") from None
        if not isinstance(record, dict) or "rank" not in record or "events" not in record:
            raise ValueError(f"{path}: not a rank trace file (needs the keys 'rank' and 'events')")
        records.append(record)
    return sorted(records, key=lambda record: record["rank"])


def rank_label(record: dict) -> str:
    """``rank 3 (node1:0, p0.s2)``; the parts a record lacks are left out."""
    parts = [str(record["device"])] if "device" in record else []
    if "pipeline" in record and "stage" in record:
        parts.append(f"p{record['pipeline']}.s{record['stage']}")
    return f"rank {record['rank']}" + (f" ({', '.join(parts)})" if parts else "")


def rank_rows(records: Sequence[dict]) -> tuple[list[str], list[Row]]:
    """Labels and ``(action, start, end)`` rows of rank records, times as recorded."""
    labels = [rank_label(record) for record in records]
    rows = [[(ev["action"], float(ev["start"]), float(ev["end"])) for ev in record["events"]]
            for record in records]
    return labels, rows


def split_steps(row: Row) -> list[Row]:
    """Cut one rank's records into steps: a step starts where the rank's first action recurs.

    Within a step every action of a rank is distinct, so the first one recurs exactly once per step.
    """
    steps: list[Row] = []
    for record in row:
        if not steps or record[0] == row[0][0]:
            steps.append([])
        steps[-1].append(record)
    return steps


def action_kind(action: str) -> str:
    """``"SEND_F3.1"`` -> ``"SEND_F"``."""
    match = _KIND_RE.match(action)
    return match[0] if match else action


def chrome_events(labels: Sequence[str], rows: Sequence[Row], *, process: str = "pipeline") -> dict:
    """A Chrome/Perfetto trace: one thread row per label, one complete ("X") event per record.

    Times are shifted so the earliest start is 0; durations are clamped at 0.
    """
    starts = [start for row in rows for _, start, _ in row]
    t0 = min(starts) if starts else 0.0
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": process}}]
    for tid, (label, row) in enumerate(zip(labels, rows)):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": label}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid,
                       "args": {"sort_index": tid}})
        for action, start, end in row:
            events.append({"ph": "X", "name": action, "cat": action_kind(action), "pid": 0, "tid": tid,
                           "ts": (start - t0) * 1e6, "dur": max(0.0, end - start) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def chrome_trace(directory: str) -> dict:
    """Merge every ``rank*.json`` in ``directory`` into one Chrome trace (one row per rank)."""
    labels, rows = rank_rows(read_rank_traces(directory))
    return chrome_events(labels, rows, process=f"trace {directory}")
