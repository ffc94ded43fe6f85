"""Helpers shared by tests/integration/test_buckets.py and tests/unit/test_buckets_in_process.py; not a test module."""

from __future__ import annotations

from pathlib import Path

from hetero_llm import layout as layout_mod
from hetero_llm.predict import trace as tracing

THREE = (
    Path(__file__).resolve().parents[1] / "layouts" / "examples" / "hot_switch.toml"
)  # DP 4 | TP 2 x DP 2 | PP 2 x TP 2


def switches(trace: Path, rank: int) -> list[str]:
    """The SWITCH actions ``rank`` recorded under ``--trace``, in order."""
    return [e["action"] for e in tracing.read_rank_traces(trace)[rank]["events"] if e["action"].startswith("SWITCH")]


def one_process(layout: Path, folder: Path) -> Path:
    """The single-process layout of the same [model], [train] and [data], without buckets."""
    lay = layout_mod.load(layout)
    head = layout.read_text().split("[cluster]")[0]
    text = head + (
        '[cluster]\n[[cluster.nodes]]\nname = "node0"\ndevices = ["cpu"]\n[[pipelines]]\n'
        f"batch = {lay.train.global_batch}\nmicrobatches = 2\n[[pipelines.stages]]\n"
        f'layers = {lay.model.layers}\ndevices = ["node0:0"]\n'
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "one_process.toml"
    path.write_text(text)
    return path
