"""--tensorboard writes every number --metrics-jsonl writes (and the throughput), at the same steps: read back
from the event file and compared with the JSONL of the same run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from harness import LAYOUTS, common_sections, free_port, write_layout
from hetero_llm.cli.launch import main

pytest.importorskip("tensorboard", reason="the 'tensorboard' extra installs tensorboard")

# the reference model, 3 steps, held-out loss after steps 2 and 3
LAYOUT = common_sections(LAYOUTS / "reference" / "reference.toml").replace(
    "log_every = 1", "log_every = 1\neval_every = 2\neval_batches = 1"
)


@pytest.mark.multiprocess
def test_tensorboard_has_every_metric_of_the_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    layout = write_layout(tmp_path / "layout.toml", LAYOUT, [(12, 3, [(6, 1)])])
    metrics, board = tmp_path / "metrics.jsonl", tmp_path / "tb"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetero_llm.cli",
            str(layout),
            "--quiet",
            "--metrics-jsonl",
            str(metrics),
            "--tensorboard",
            str(board),
            "--set",
            f"cluster.port={free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    keys = {k for row in rows for k in row} - {"step"}
    assert {"loss", "valid_loss", "lr", "grad_norm", "tokens", "seconds"} <= keys  # what the JSONL has today

    events = EventAccumulator(str(board))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {f"train/{k}" for k in keys} | {"train/tokens_per_second"}
    for key in keys:  # the same numbers at the same steps (TensorBoard keeps float32)
        want = [(row["step"], row[key]) for row in rows if key in row]
        got = [(e.step, e.value) for e in events.Scalars(f"train/{key}")]
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert all(math.isclose(g, w, rel_tol=1e-6) for (_, g), (_, w) in zip(got, want)), (key, got, want)
    rates = [(e.step, e.value) for e in events.Scalars("train/tokens_per_second")]
    assert [s for s, _ in rates] == [row["step"] for row in rows]
    assert all(math.isclose(v, row["tokens"] / row["seconds"], rel_tol=1e-6) for (_, v), row in zip(rates, rows))

    # the option's help names them all
    help_text = " ".join(next(p for p in main.params if "--tensorboard" in p.opts).help.split())
    assert all(k in help_text for k in keys | {"tokens_per_second"}), help_text
