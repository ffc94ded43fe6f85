"""The tests of tests/unit/test_held_out.py that start processes or train for real (the integration tier).

Held-out evaluation: the same held-out batches under every layout, the loss a one-process model gives on
them, printed next to the training loss and written to the metrics JSONL with the console's step numbers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from harness import LAYOUTS, RTOL, common_sections, free_port, launch, write_layout
from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint.shards import load_full_params
from hetero_llm.data import held_out, sources
from hetero_llm.model.forward import StageShape, stage_forward, token_loss_sum

COMMON = common_sections(LAYOUTS / "reference" / "reference.toml").replace(
    "log_every = 1", "log_every = 1\neval_every = 2\neval_batches = 2"
)


def run_console(layout, workdir, *extra):
    """hetero-launch without --quiet: the console lines and the metrics rows."""
    metrics, ckpt = workdir / "metrics.jsonl", workdir / "ckpt"
    cmd = [
        sys.executable,
        "-m",
        "hetero_llm.cli",
        str(layout),
        "--metrics-jsonl",
        str(metrics),
        "--checkpoint",
        str(ckpt),
        "--set",
        f"cluster.port={free_port()}",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.mark.multiprocess
def test_held_out_loss_is_the_same_under_every_layout(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    one = write_layout(tmp_path / "one" / "layout.toml", COMMON, [(12, 3, [(6, 1)])])
    tensorboard = importlib.util.find_spec("tensorboard") is not None  # the 'tensorboard' extra
    stdout, rows = run_console(one, tmp_path / "one", *(["--tensorboard", str(tmp_path / "tb")] if tensorboard else []))
    # console and JSONL count steps alike, from 1; the evaluating steps carry valid_loss
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [("valid_loss" in r) for r in rows] == [False, True, True]
    for r in rows:
        line = next(x for x in stdout.splitlines() if x.startswith(f"step {r['step']:>5}/3 | loss {r['loss']:.4f}"))
        assert ("| valid " in line) == ("valid_loss" in r)
        if "valid_loss" in r:
            assert f"| valid {r['valid_loss']:.4f} |" in line

    if tensorboard:  # the same numbers at the same steps as TensorBoard scalars
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        assert [(e.step, round(e.value, 5)) for e in events.Scalars("train/loss")] == [
            (r["step"], round(r["loss"], 5)) for r in rows
        ]
        assert [e.step for e in events.Scalars("train/valid_loss")] == [2, 3]

    zero1 = COMMON.replace('schedule = "1f1b"', 'schedule = "1f1b"\noptimizer = "adamw_zero1"')  # AG before evaluating
    many = launch(
        write_layout(
            tmp_path / "many" / "layout.toml",
            zero1,
            [(8, 4, [(2, 1), (3, 2), (1, 1)]), (4, 2, [(4, 2), (2, 2)])],
            "zbh1",
        ),
        tmp_path / "many",
    )
    many_rows = [json.loads(line) for line in (tmp_path / "many" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(many_rows, rows):
        assert a.keys() == b.keys()
        if "valid_loss" in b:
            assert abs(a["valid_loss"] - b["valid_loss"]) <= RTOL * b["valid_loss"]

    # the logged loss is the final model's mean loss over exactly held-out batches 0 and 1
    lay = layout_mod.load(one)
    params = load_full_params(str(tmp_path / "one" / "ckpt"))
    train, valid = sources.train_and_held_out(lay.data, lay.file)
    total = 0.0
    with torch.no_grad():
        for index in range(2):
            batch = torch.from_numpy(held_out.batch(valid, lay.train.seed, index, 12, lay.model.seq_len))
            logits = stage_forward(params, batch[:, :-1], StageShape(0, 6, True, True), lay.model)
            total += float(token_loss_sum(logits, batch[:, 1:]))
    assert abs(total / (2 * 12 * 16) - rows[-1]["valid_loss"]) <= RTOL * rows[-1]["valid_loss"]
    assert many.losses  # trained
