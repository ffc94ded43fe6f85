"""Per-action timing records (``--trace DIR``) and their merge into a Chrome/Perfetto trace."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hetero_llm.plan import Plan


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


def chrome_trace(directory: str) -> dict:
    """Merge every ``rank*.json`` in ``directory`` into one Chrome trace (one row per rank)."""
    ranks = [json.loads(p.read_text()) for p in sorted(Path(directory).glob("rank*.json"))]
    if not ranks:
        raise FileNotFoundError(f"{directory}: no rank*.json trace files (run with --trace {directory})")
    t0 = min(ev["start"] for r in ranks for ev in r["events"]) if any(r["events"] for r in ranks) else 0.0
    events = []
    for r in ranks:
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": r["rank"],
                       "args": {"name": f"rank {r['rank']} ({r['device']}, p{r['pipeline']}.s{r['stage']})"}})
        for ev in r["events"]:
            kind = ev["action"].rstrip("0123456789.").split(".")[0]
            events.append({"ph": "X", "name": ev["action"], "cat": kind, "pid": 0, "tid": r["rank"],
                           "ts": (ev["start"] - t0) * 1e6, "dur": (ev["end"] - ev["start"]) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
