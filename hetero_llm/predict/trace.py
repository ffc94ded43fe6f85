"""Per-action timing records (``--trace DIR``) and their merge into a Chrome/Perfetto trace.

Each rank streams ``rank{R}.jsonl`` as it runs (``RankTraceWriter``): a first line ``{"rank",
"pipeline", "stage", "device"}``, then lines ``{"events": [[action, start, end], ...]}``, each holding
the events of up to ``FLUSH_S`` seconds, with times in seconds of ``time.perf_counter()`` (one clock per
host, so ranks of one host line up; ranks on different hosts are shifted by their clocks' offset). Each
line is written whole by one ``write``, so a job that dies keeps all but its last moments' events, and a
rank holds at most ``FLUSH_S`` seconds of them (or ``FLUSH_EVENTS``) in memory.
Readers also take ``rank{R}.json``, the whole-run record earlier versions wrote at the end:
``{"rank", "pipeline", "stage", "device", "events": [{"action", "start", "end"}, ...]}``. The events of
every step follow one another; ``split_steps`` cuts them into steps.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # reading traces needs no plan
    from hetero_llm.plan.rank import RankPlan

Row = list[tuple[str, float, float]]
"""One rank's or stage's ``(action string, start s, end s)`` records."""

_KIND_RE = re.compile(r"[A-Z_]+")


def write_rank_trace(directory: str, rp: RankPlan, events: list[tuple[str, float, float]]) -> None:
    """Write ``rank{R}.json``: this rank's (action, start, end) records, atomically."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rank = rp.rank
    record = {**_header(rp), "events": [{"action": a, "start": s, "end": e} for a, s, e in events]}
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / f"rank{rank}.json")


FLUSH_S = 0.5  # seconds of events a line holds at most
FLUSH_EVENTS = 4096  # events a line holds at most


class RankTraceWriter:
    """Streams one rank's ``(action, start, end)`` records into ``rank{R}.jsonl`` as the runtime ``append``s them."""

    def __init__(self, directory: str, rp: RankPlan):
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        # An earlier run's files in this folder would read as ranks of this one.
        rank = rp.rank
        stale = [out / f"rank{rank}.json"]
        if rank == 0:
            stale += [p for p in out.glob("rank*.json*") if (r := _rank_of_file(p)) is not None and r >= rp.world_size]
        for path in stale:
            path.unlink(missing_ok=True)
        self._fd: int | None = os.open(
            out / f"rank{rank}.jsonl",  # never through a link planted there
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
            0o644,
        )
        self._write(_header(rp))
        self._pending: list[tuple[str, float, float]] = []

    def append(self, record: tuple[str, float, float]) -> None:
        self._pending.append(record)
        if record[2] - self._pending[0][1] >= FLUSH_S or len(self._pending) >= FLUSH_EVENTS:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._write({"events": self._pending})
            self._pending = []

    def close(self) -> None:
        if self._fd is not None:
            self.flush()
            os.close(self._fd)
            self._fd = None

    def _write(self, line: dict) -> None:
        assert self._fd is not None  # written only while open
        os.write(self._fd, (json.dumps(line) + "\n").encode())  # one write per line: no torn line but the last


def _header(rp: RankPlan) -> dict:
    return {"rank": rp.rank, "pipeline": rp.info.pipeline, "stage": rp.info.stage, "device": rp.info.device_id}


def _rank_of_file(path: Path) -> int | None:
    digits = path.name.removeprefix("rank").split(".", 1)[0]
    return int(digits) if digits.isdigit() else None


def read_rank_traces(directory: str | Path) -> list[dict]:
    """Every rank's record in ``directory`` (``rank*.jsonl`` or ``rank*.json``), ordered by rank."""
    paths = [p for p in Path(directory).glob("rank*.json*") if p.suffix in (".json", ".jsonl")]
    if not paths:
        raise FileNotFoundError(f"{directory}: no rank*.json trace files (run with --trace {directory})")
    records = []
    for path in paths:
        record = _read_streamed(path) if path.suffix == ".jsonl" else _read_whole(path)
        if not isinstance(record, dict) or "rank" not in record or "events" not in record:
            raise ValueError(f"{path}: not a rank trace file (needs the keys 'rank' and 'events')")
        records.append(record)
    ranks = [record["rank"] for record in records]
    if len(set(ranks)) != len(ranks):
        twice = next(r for r in ranks if ranks.count(r) > 1)
        raise ValueError(
            f"{directory}: two trace files of rank {twice} (rank{twice}.json and rank{twice}.jsonl: remove the older)"
        )
    return sorted(records, key=lambda record: record["rank"])


def _read_whole(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None


def _read_streamed(path: Path) -> dict:
    """A ``rank{R}.jsonl`` file, possibly of a job that died: a torn last line is dropped."""
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except ValueError as error:
            if number == len(lines) and number > 1:
                break  # written when the job died
            raise ValueError(f"{path}: line {number} is not JSON ({error})") from None
    if not records or not isinstance(records[0], dict) or not all(isinstance(r, dict) for r in records):
        return {}
    header, steps = records[0], records[1:]
    if any(not isinstance(step.get("events"), list) for step in steps):
        raise ValueError(f"{path}: not a rank trace file (each line after the first needs the key 'events')")
    return {**header, "events": [{"action": a, "start": s, "end": e} for step in steps for a, s, e in step["events"]]}


def rank_label(record: dict) -> str:
    """``rank 3 (node1:0, p0.s2)``; the parts a record lacks are left out."""
    parts = [str(record["device"])] if "device" in record else []
    if "pipeline" in record and "stage" in record:
        parts.append(f"p{record['pipeline']}.s{record['stage']}")
    return f"rank {record['rank']}" + (f" ({', '.join(parts)})" if parts else "")


def rank_rows(records: Sequence[dict]) -> tuple[list[str], list[Row]]:
    """Labels and ``(action, start, end)`` rows of rank records, times as recorded."""
    labels = [rank_label(record) for record in records]
    rows = [[(ev["action"], float(ev["start"]), float(ev["end"])) for ev in record["events"]] for record in records]
    return labels, rows


def split_steps(row: Row) -> list[Row]:
    """Cut one rank's records into steps at each recurrence of its first compute action.

    Every compute action (``F``, ``B``, ``I``, ``W``) runs once per step; a receive is recorded twice
    (posted, and waited for), so it cannot mark a step. Receive records just before that compute
    action belong to the step it opens.
    """
    first = next((a for a, _, _ in row if a[0] in "FBIW"), None)
    cuts = [i for i, (a, _, _) in enumerate(row) if a == first]
    starts: list[int] = []
    for i in cuts:
        while i > 0 and row[i - 1][0].startswith("RECV") and (not starts or i - 1 >= starts[-1]):
            i -= 1
        starts.append(i)
    if starts:
        starts[0] = 0
    return [row[a:b] for a, b in zip(starts, starts[1:] + [len(row)])]


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
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid, "args": {"sort_index": tid}})
        for action, start, end in row:
            events.append(
                {
                    "ph": "X",
                    "name": action,
                    "cat": action_kind(action),
                    "pid": 0,
                    "tid": tid,
                    "ts": (start - t0) * 1e6,
                    "dur": max(0.0, end - start) * 1e6,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def chrome_trace(directory: str) -> dict:
    """Merge every ``rank*.json`` in ``directory`` into one Chrome trace (one row per rank)."""
    labels, rows = rank_rows(read_rank_traces(directory))
    return chrome_events(labels, rows, process=f"trace {directory}")
