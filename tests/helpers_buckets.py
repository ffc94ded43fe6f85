"""Helpers shared by tests/integration/test_buckets.py and tests/unit/test_buckets_in_process.py; not a test module."""

from __future__ import annotations

from pathlib import Path

from hetero_llm.predict import trace as tracing

THREE = (
    Path(__file__).resolve().parents[1] / "layouts" / "examples" / "hot_switch.toml"
)  # DP 4 | TP 2 x DP 2 | PP 2 x TP 2


def switches(trace: Path, rank: int) -> list[str]:
    """The SWITCH actions ``rank`` recorded under ``--trace``, in order."""
    return [e["action"] for e in tracing.read_rank_traces(trace)[rank]["events"] if e["action"].startswith("SWITCH")]
