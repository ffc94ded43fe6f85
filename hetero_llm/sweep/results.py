"""A sweep's results: one JSON line per point in ``results.jsonl`` (appended whole, fsynced), read back to resume,
exported to CSV, and the slices of a sharded sweep merged."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hetero_llm._fs import write_atomically
from hetero_llm.errors import LayoutError

RESULTS = "results.jsonl"
CSV = "results.csv"
DONE = (
    "ok",
    "failed",
    "timeout",
    "predicted",
    "unpriced",
    "invalid",
)  # statuses a rerun does not redo (failed: --retry-failed)


def key(record: dict[str, Any]) -> tuple[str, str, str]:
    """What makes two records the same point's: the resolved layout's hash (the --set items of an invalid point),
    the code version and the mode."""
    return (record["hash"] or "sets:" + "\0".join(record["sets"]), record["version"], record["mode"])


def read(path: Path) -> list[dict[str, Any]]:
    """The records of a results file (none if it does not exist). A last line cut short by a kill is dropped, and
    cut from the file, so the next append starts a line of its own."""
    if not path.exists():
        return []
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if whole != data:
        write_atomically(path, lambda f: f.write(whole))
    out = []
    for n, line in enumerate(whole.decode().splitlines(), 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            raise LayoutError(str(path), f"line {n}", "not a JSON record (a results file of hetero-sweep?)") from None
    return out


def append(path: Path, record: dict[str, Any]) -> None:
    """One record as one line, in one write, on disk before this returns (a kill leaves it whole or cut short)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def latest(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per point (the last written wins: a retried failure's), in point order."""
    by_key: dict[tuple, dict[str, Any]] = {}
    for r in records:
        by_key.pop(key(r), None)
        by_key[key(r)] = r
    return sorted(by_key.values(), key=lambda r: r["point"])


COLUMNS = [
    ("point", "point"),
    ("status", "status"),
    ("hash", "hash"),
    ("predicted_step_time_s", "predicted.step_time_s"),
    ("predicted_tokens_per_s", "predicted.tokens_per_s"),
    ("predicted_peak_memory_gb", "predicted.peak_memory_gb"),
    ("step_time_s", "measured.step_time_s"),
    ("step_time_p90_s", "measured.step_time_p90_s"),
    ("tokens_per_s", "measured.tokens_per_s"),
    ("peak_rss_gb", "measured.peak_rss_gb"),
    ("final_loss", "measured.final_loss"),
    ("valid_loss", "measured.valid_loss"),
    ("exit_code", "exit_code"),
    ("error", "error"),
]


def field(record: dict[str, Any], dotted: str) -> Any:
    value: Any = record
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def write_csv(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """The records as a table, one column per axis then the figures, written whole."""
    axes = list(dict.fromkeys(k for r in records for k in r["axes"]))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(axes + [name for name, _ in COLUMNS])
    for r in records:
        w.writerow([r["axes"].get(a, "") for a in axes] + [_cell(field(r, dotted)) for _, dotted in COLUMNS])
    write_atomically(path, lambda f: f.write(buf.getvalue().encode()))


def _cell(value: Any) -> Any:
    return "" if value is None else value


def merge(out: Path, slices: Sequence[Path]) -> list[dict[str, Any]]:
    """``hetero-sweep merge OUT SLICE...``: the slices' records in one results file (and its CSV), one per point."""
    if not slices:
        raise LayoutError(str(out), "merge", "name the slices' output folders to join (hetero-sweep merge OUT A B ...)")
    records = []
    for s in slices:
        if not (s / RESULTS).is_file():
            raise LayoutError(
                str(s), RESULTS, "no results here (pass the --out folder of a sweep or of a --shard slice)"
            )
        records += read(s / RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    joined = latest(records)
    text = "".join(json.dumps(r) + "\n" for r in joined)
    write_atomically(out / RESULTS, lambda f: f.write(text.encode()))
    write_csv(out / CSV, joined)
    return joined
