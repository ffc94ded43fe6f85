"""The paired comparison's driver: ``paired_rank.py``'s rank processes started to completion, and the
tokens/s and CPU seconds of both sides read from rank 0's result.

Scripts import it as ``from bench.pipeline import paired``; the ranks are started with ``benchlib.start_ranks``.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common.benchlib import free_port, median, start_ranks, tokens_per_second


def run_paired(
    layout: Path,
    workdir: Path,
    world: int,
    rounds: int,
    steps: int,
    *,
    versus: str = "torch",
    env: dict[str, str] | None = None,
) -> dict:
    """``paired_rank.py``: the layout's own side and ``versus`` (torch's pipelining, or another
    ``train.schedule``) in alternating rounds inside the same rank processes; rank 0's results."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "paired.json"
    start_ranks(
        "bench.pipeline.paired_rank",
        [
            str(layout),
            "--port",
            str(free_port()),
            "--rounds",
            str(rounds),
            "--steps",
            str(steps),
            "--out",
            str(out),
            "--versus",
            versus,
        ],
        world,
        env=env,
    )
    return json.loads(out.read_text())


def paired_rates(got: dict, tokens_per_step: int, steps: int) -> tuple[list[float], list[float], dict[str, float]]:
    """``run_paired``'s result: tokens/s of "ours" and of "other" in each round (the first step is warm-up),
    and each side's CPU seconds per step, every rank together (median over rounds)."""

    def rate(rows):
        return tokens_per_second([r["seconds"] for r in rows], tokens_per_step, 1)

    ours, other = [rate(rows) for rows in got["ours"]], [rate(rows) for rows in got["other"]]
    cpu = {
        side: median([sum(rank[side][i] for rank in got["cpu"]) / steps for i in range(len(ours))])
        for side in ("ours", "other")
    }
    return ours, other, cpu
