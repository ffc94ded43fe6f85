"""What peer replicas of the snapshots cost per step (``checkpoint/replicas.py``, ``--snapshot-every 1``).

The reference model (``--hidden`` sets its width) as two pipelines of two stages over two emulated nodes (4 ranks,
``snapshot_restart.dp_pp_plan``: n0 runs both stage-0 ranks, n1 both stage-1 ranks, so losing n1 without replicas
loses stage 1), each rank a process of the plain launcher (CPU gloo, one thread each), each node's snapshots in a
folder of its own under /dev/shm. Three modes, interleaved ``reps`` times: no snapshot; a snapshot every step
into the rank's own node's folder only (replicas off); a snapshot every step with its replica sent to the rank
of the other node, which writes it into its node's folder (the default). The cost of each is the median step
time (``--metrics-jsonl``'s ``seconds``, steps after the first two) over the no-snapshot run's. Mode: one machine,
processes, CPU. Usage: ``python -m bench.elastic.replica_cost [--hidden 128] [--quick]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import click

from bench.common import benchlib as B
from bench.elastic import snapshot_restart
from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint import snapshots
from hetero_llm.launch.node import run_ranks
from hetero_llm.plan import compile_plan
from hetero_llm.train import checkpointing
from hetero_llm.train.options import RunOptions

NAME = "replica_cost"
MODES = ("none", "snapshot, own node only", "snapshot + replica on the other node")
_snapshot = checkpointing.Saver.snapshot
_group = checkpointing._replica_group
_exchange = snapshots.SnapshotWriter._exchange


def _own_node_folder(self, state, optimizer, done):
    """Each rank's snapshots into its node's folder (``shm/NODE/round``; the forked ranks inherit this)."""
    if self.snapshots is None:
        node = self.rp.info.device_id.split(":")[0]
        self.snapshot_root = str(Path(self.snapshot_root).parent / node / "round")
    return _snapshot(self, state, optimizer, done)


def _timed_exchange(log: Path):
    """``SnapshotWriter._exchange`` that appends its milliseconds to ``log`` (one line per call, from every rank)."""

    def exchange(self, step, pt, record):
        t0 = time.perf_counter()
        try:
            return _exchange(self, step, pt, record)
        finally:
            with open(log, "a") as f:
                f.write(f"{1e3 * (time.perf_counter() - t0):.3f} {len(pt)}\n")

    return exchange


def run_once(tmp: Path, shm: Path, mode: str, steps: int, hidden: int, tag: str) -> tuple[float, list[str]]:
    """The median seconds per step of one run in ``mode`` (steps after the first two), and the replica exchanges'
    lines (milliseconds in the background thread, bytes sent)."""
    snapshot_restart.dp_pp_plan(tmp, hidden, steps)  # its layout file, given a free port below
    path = tmp / f"dp_pp_h{hidden}.toml"
    path.write_text(path.read_text().replace("[cluster]\n", f"[cluster]\nport = {B.free_port()}\n", 1))
    plan = compile_plan(layout_mod.load(str(path)))
    metrics = tmp / f"{tag}.jsonl"
    snapshot = (str(shm / tag / "unused"), 1) if mode != MODES[0] else (None, 0)
    options = RunOptions(quiet=True, checkpoint=str(tmp / tag), metrics_jsonl=str(metrics), snapshot=snapshot)
    checkpointing._replica_group = _group if mode == MODES[2] else lambda rp: None  # type: ignore[assignment]
    log = tmp / f"{tag}.exchanges"
    snapshots.SnapshotWriter._exchange = _timed_exchange(log)  # type: ignore[method-assign]
    try:
        run_ranks(plan, list(range(plan.world_size)), options)
    finally:
        checkpointing._replica_group = _group
        snapshots.SnapshotWriter._exchange = _exchange  # type: ignore[method-assign]
    exchanges = log.read_text().splitlines() if log.exists() else []
    seconds = [json.loads(line)["seconds"] for line in metrics.read_text().splitlines()][2:]
    if mode != MODES[0]:  # what the run left: its own files and, with replicas, the other node's too
        held = {n: len(list((shm / tag / n).rglob("rank*.json"))) for n in ("n0", "n1")}
        assert held == ({"n0": 4, "n1": 4} if mode == MODES[1] else {"n0": 8, "n1": 8}), held
    shutil.rmtree(shm / tag, ignore_errors=True)
    shutil.rmtree(tmp / tag, ignore_errors=True)
    return statistics.median(seconds), exchanges


@click.command()
@click.option("--quick", is_flag=True, help="Smoke run: fewer steps, one repetition.")
@click.option("--hidden", default=32, show_default=True, help="The model's width (the reference model's: 32).")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=B.RESULTS, show_default=True)
def main(quick, hidden, out_dir):
    """The cost per step of a snapshot every step, without and with its peer replica."""
    steps, reps = (6, 1) if quick else (20, 3)
    info, before = B.machine(), B.load_average()
    B.say(f"{NAME}: {B.machine_line(info)}; load {before[0]:.2f}")
    checkpointing.Saver.snapshot = _own_node_folder  # type: ignore[method-assign]
    per_step: dict[str, list[float]] = {m: [] for m in MODES}
    exchanged: list[str] = []
    shm = Path("/dev/shm") / f"bench_replica_cost_{os.getpid()}"
    try:
        with tempfile.TemporaryDirectory(prefix="bench_replica_cost_") as tmp:
            for rep in range(reps):
                for i, mode in enumerate(MODES):
                    seconds, lines = run_once(Path(tmp), shm, mode, steps, hidden, f"r{rep}m{i}")
                    per_step[mode].append(seconds)
                    exchanged += lines
                    B.say(f"  {mode}: {1e3 * per_step[mode][-1]:.1f} ms per step")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        checkpointing.Saver.snapshot = _snapshot  # type: ignore[method-assign]
    after = B.load_average()
    base = statistics.median(per_step[MODES[0]])
    rows = [
        {
            "mode": m,
            "ms_per_step": 1e3 * statistics.median(per_step[m]),
            "cost_ms": 1e3 * (statistics.median(per_step[m]) - base),
        }
        for m in MODES
    ]
    exchange_ms = statistics.median(float(line.split()[0]) for line in exchanged)
    sent_mb = statistics.median(int(line.split()[1]) for line in exchanged) / 1e6
    md = "\n".join(
        [
            *B.report_head(NAME, info, before, after),
            f"The reference model (hidden {hidden}), 2 pipelines x 2 stages over two emulated nodes (4 rank processes, "
            f"CPU gloo, OMP_NUM_THREADS=1), {steps} steps, {reps} interleaved run(s) per mode, medians of the step "
            "time (steps 3 on).",
            "",
            "| mode | ms per step | cost ms per step |",
            "| --- | --- | --- |",
            *[f"| {r['mode']} | {r['ms_per_step']:.1f} | {r['cost_ms']:+.1f} |" for r in rows],
            "",
            f"A replica exchange (in the snapshot's background thread: send its snapshot, receive and check and write "
            f"the one it keeps): median {exchange_ms:.1f} ms for {sent_mb:.2f} MB per rank, over {len(exchanged)} "
            "exchanges.",
        ]
    )
    B.say(md)
    name = NAME if hidden == 32 else f"{NAME}_h{hidden}"
    B.write_results(
        out_dir,
        name,
        md,
        {
            "hidden": hidden,
            "steps": steps,
            "reps": reps,
            "load": [before, after],
            "rows": rows,
            "exchange_ms": exchange_ms,
            "sent_mb": sent_mb,
        },
    )


if __name__ == "__main__":
    main()
