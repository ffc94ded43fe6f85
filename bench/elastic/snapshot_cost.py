"""What an elastic run's in-memory snapshot costs per step (``--snapshot-every 1``), before and after overlapping it.

The reference model, one rank, run in this process (``launch.node.run_rank``, CPU gloo, one thread) for
``steps`` steps in four ways, interleaved ``reps`` times: no save; a synchronous save every step into a folder on
disk; a synchronous save every step into /dev/shm (what a snapshot was before: the same ``save_checkpoint``); the
overlapped snapshot every step into /dev/shm (a CPU copy at the step boundary, written by a background thread:
``checkpoint/snapshots.py``). The cost per step of each is its median wall time over the no-save run's, over
``steps``; and, less at the mercy of the machine's load, the median time the training thread is held by one
save or snapshot call (the synchronous save: all of it; the overlapped snapshot: the CPU copy, plus waiting for
the previous write when it is not done). Usage: ``python -m bench.elastic.snapshot_cost [--quick]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import attrs
import click

from bench.common import benchlib as B
from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint import snapshots
from hetero_llm.launch.node import run_rank
from hetero_llm.model.params import all_params
from hetero_llm.plan import compile_plan
from hetero_llm.train import checkpointing
from hetero_llm.train.options import RunOptions

NAME = "snapshot_cost"
REFERENCE = B.ROOT / "layouts" / "reference" / "reference.toml"
BLOCKED: list[float] = []  # seconds the training thread spent in each save or snapshot call of the current run
WAITED: list[float] = []  # of which, in a snapshot, waiting for the previous snapshot's write


def _timed(method, into: list[float]):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    return timed


MODES = ("none", "disk, synchronous", "/dev/shm, synchronous", "/dev/shm, overlapped")


def run_once(tmp: Path, shm: Path, mode: str, steps: int, tag: str, hidden: int) -> tuple[float, float, float]:
    """Wall seconds of one run in ``mode`` (``hidden``: the model's width; the reference's is 32), and the median
        milliseconds the training thread was held by a save or a snapshot (0 without), and of a snapshot's, how
    long it waited for the previous write."""
    text = REFERENCE.read_text().replace("steps = 3", f"steps = {steps}").replace("hidden = 32", f"hidden = {hidden}")
    path = tmp / f"{tag}.toml"
    path.write_text(text.replace("[cluster]\n", f"[cluster]\nport = {B.free_port()}\n", 1))
    plan = compile_plan(layout_mod.load(str(path)))
    options = RunOptions(quiet=True)
    if mode == MODES[1]:
        options = RunOptions(quiet=True, checkpoint=str(tmp / tag), checkpoint_every=1)
    elif mode == MODES[2]:
        options = RunOptions(quiet=True, checkpoint=str(shm / tag), checkpoint_every=1)
    elif mode == MODES[3]:
        options = RunOptions(quiet=True, checkpoint=str(tmp / tag), snapshot=(str(shm / tag), 1))
    BLOCKED.clear()
    WAITED.clear()
    t0 = time.perf_counter()
    run_rank(plan, 0, options)
    seconds = time.perf_counter() - t0
    held = 1e3 * statistics.median(BLOCKED) if BLOCKED else 0.0
    waited = 1e3 * statistics.median(WAITED[: len(BLOCKED)]) if WAITED and mode == MODES[3] else 0.0
    shutil.rmtree(shm / tag, ignore_errors=True)
    shutil.rmtree(tmp / tag, ignore_errors=True)
    return seconds, held, waited


@click.command()
@click.option("--quick", is_flag=True, help="Smoke run: fewer steps, one repetition.")
@click.option("--hidden", default=32, show_default=True, help="The model's width (the reference model's: 32).")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=B.RESULTS, show_default=True)
def main(quick, hidden, out_dir):
    """The cost per step of a snapshot every step, synchronous and overlapped."""
    steps, reps = (10, 1) if quick else (40, 3)
    info, before = B.machine(), B.load_average()
    B.say(f"{NAME}: {B.machine_line(info)}; load {before[0]:.2f}")
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    held: dict[str, list[float]] = {m: [] for m in MODES}
    waited: dict[str, list[float]] = {m: [] for m in MODES}
    checkpointing.Saver.save = _timed(checkpointing.Saver.save, BLOCKED)  # type: ignore[method-assign]
    checkpointing.Saver.snapshot = _timed(checkpointing.Saver.snapshot, BLOCKED)
    snapshots.SnapshotWriter.wait = _timed(snapshots.SnapshotWriter.wait, WAITED)  # type: ignore[method-assign]  # type: ignore[method-assign]
    shm = Path("/dev/shm") / f"bench_snapshot_cost_{os.getpid()}"
    try:
        with tempfile.TemporaryDirectory(prefix="bench_snapshot_cost_") as tmp:
            run_once(Path(tmp), shm, MODES[0], 2, "warm", hidden)  # imports, first-use costs
            for rep in range(reps):
                for i, mode in enumerate(MODES):
                    wall, blocked, wait = run_once(Path(tmp), shm, mode, steps, f"r{rep}m{i}", hidden)
                    walls[mode].append(wall)
                    held[mode].append(blocked)
                    waited[mode].append(wait)
                    B.say(f"  {mode}: {wall:.2f} s, the training thread held {blocked:.1f} ms per save")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    after = B.load_average()
    base = statistics.median(walls[MODES[0]])
    model = layout_mod.load(str(REFERENCE)).model
    # parameters, exp_avg and exp_avg_sq in float32
    state_mb = 12 * sum(math.prod(p.shape) for p in all_params(attrs.evolve(model, hidden=hidden))) / 1e6
    rows = [
        {
            "mode": m,
            "wall_s": statistics.median(walls[m]),
            "ms_per_step": 1e3 * (statistics.median(walls[m]) - base) / steps,
            "held_ms": statistics.median(held[m]),
            "of_which_waiting_ms": statistics.median(waited[m]),
        }
        for m in MODES
    ]
    md = "\n".join(
        [
            *B.report_head(NAME, info, before, after),
            f"The reference model (hidden {hidden}: {state_mb:.1f} MB of parameters and moments per snapshot), one "
            f"rank in one process (CPU gloo, OMP_NUM_THREADS=1), {steps} steps, {reps} interleaved run(s) per mode, "
            "medians.",
            "",
            "| mode | wall s | cost ms/step (wall) | training thread held ms/save | of which waiting ms |",
            "| --- | --- | --- | --- | --- |",
            *[
                f"| {r['mode']} | {r['wall_s']:.2f} | {r['ms_per_step']:.1f} | {r['held_ms']:.1f} | "
                f"{r['of_which_waiting_ms']:.1f} |"
                for r in rows
            ],
        ]
    )
    B.say(md)
    name = NAME if hidden == 32 else f"{NAME}_h{hidden}"
    payload = {"hidden": hidden, "state_mb": state_mb, "steps": steps, "reps": reps, "load": [before, after]}
    B.write_results(out_dir, name, md, {**payload, "rows": rows})


if __name__ == "__main__":
    main()
