"""Resident memory of the ranks of a long run: does it level off?

A tiny model on 2 ranks (two pipeline stages, one computing rank per core) trains ``--steps`` steps under
``hetero-launch``; this script samples every rank's resident memory (``VmRSS`` of ``/proc/PID/status``,
the processes named ``hl-rank<R>``) as the metrics file reaches each sample step, and reports the growth
from ``--from-step`` to the last sample step. The target (issue 10 §7): under 1% from step 1000 to step 10000.

    python -m bench.memory.soak --out-dir bench/results          # 10000 steps, ~2 minutes on 2 cores
    python -m bench.memory.soak --quick --out-dir /tmp/soak      # 400 steps: the script works (tests run this)

The run trains ``--steps`` plus a few more steps, so the last sample is taken while the ranks still run.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import click

from bench.common import benchlib as B
from hetero_llm import layout as L


def soak_layout(file: str, steps: int) -> L.Layout:
    """A tiny model in two stages of one layer, one CPU rank each, trained ``steps`` steps."""
    model = L.ModelSpec(layers=2, hidden=32, heads=4, vocab=64, seq_len=16)
    train = L.TrainSpec(steps=steps, global_batch=4, seed=7, schedule=L.Schedule.ONE_F_ONE_B, log_every=1000)
    stages = (L.StageSpec(layers=1, devices=("n0:0",)), L.StageSpec(layers=1, devices=("n0:1",)))
    return L.Layout(
        file=file,
        model=model,
        train=train,
        data=L.DataSpec(),
        cluster=L.ClusterSpec(nodes=(L.NodeSpec(name="n0", devices=("cpu", "cpu")),)),
        pipelines=(L.PipelineSpec(batch=4, microbatches=2, stages=stages),),
    )


MARGIN = 50  # steps trained after the last sample, so it is taken from running ranks


def rank_pids(parent: int) -> dict[int, int]:
    """rank -> pid of the launcher's children named ``hl-rank<R>``."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and name.startswith("hl-rank"):
            out[int(name.removeprefix("hl-rank"))] = int(entry.name)
    return out


def rss_kib(pid: int) -> int:
    return status_kib(pid)["VmRSS"]


def status_kib(pid: int) -> dict[str, int]:
    """The memory lines of ``/proc/PID/status`` (VmRSS = RssAnon + RssFile + RssShmem), in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.startswith(("Vm", "Rss")):
            out[key] = int(value.split()[0])
    return out


class StepCounter:
    """Steps done so far: the lines of the metrics file, read incrementally."""

    def __init__(self, path: Path):
        self.path, self.offset, self.lines = path, 0, 0

    def poll(self) -> int:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
            self.offset += len(chunk)
            self.lines += chunk.count(b"\n")
        return self.lines


def soak(workdir: Path, steps: int, samples: list[int]) -> dict[int, dict[int, int]]:
    """Run the layout for ``steps`` (+ MARGIN) steps; {sample step: {rank: RSS KiB}}."""
    layout = workdir / "soak.toml"
    L.dump(soak_layout(str(layout), steps + MARGIN), layout)
    metrics = workdir / "metrics.jsonl"
    proc = subprocess.Popen(
        B.launch_command(layout, metrics=metrics, port=B.free_port()),
        env=B.clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    counter, taken, pending = StepCounter(metrics), {}, list(samples)
    try:
        while pending and proc.poll() is None:
            done = counter.poll()
            if done >= pending[0]:
                pids = rank_pids(proc.pid)
                taken[pending.pop(0)] = {r: rss_kib(pid) for r, pid in sorted(pids.items())}
                B.say(f"step {done}: RSS KiB {taken[max(taken)]}")
            time.sleep(0.02)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or pending:
        raise SystemExit(f"soak run failed ({proc.returncode}; samples not taken: {pending}):\n{out}\n{err}")
    return taken


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--steps", default=10000, show_default=True, help="The last sample step.")
@click.option("--from-step", default=1000, show_default=True, help="Growth is measured from this step.")
@click.option("--every", default=1000, show_default=True, help="Sample every this many steps.")
@click.option("--quick", is_flag=True, help="400 steps, from step 100 (checks the script, not the target).")
@click.option(
    "--out-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Also write soak.md and soak.json there.",
)
def main(steps, from_step, every, quick, out_dir):
    """Resident memory per rank over a long 2-rank run, and its growth from --from-step to --steps."""
    if quick:
        steps, from_step, every = 400, 100, 100
    samples = sorted({from_step, *range(every, steps + 1, every), steps})
    before = B.load_average()
    with tempfile.TemporaryDirectory(prefix="bench_soak_") as tmp:
        t0 = time.perf_counter()
        taken = soak(Path(tmp), steps, samples)
        wall = time.perf_counter() - t0
    ranks = sorted(taken[steps])
    growth = {r: (taken[steps][r] - taken[from_step][r]) / taken[from_step][r] for r in ranks}
    per_step = {r: (taken[steps][r] - taken[from_step][r]) * 1024 / (steps - from_step) for r in ranks}
    rows = [[s, *(f"{taken[s][r] / 1024:.1f}" for r in ranks)] for s in sorted(taken)]
    table = B.markdown_table(["step", *(f"rank {r} RSS MiB" for r in ranks)], rows)
    summary = B.markdown_table(
        ["rank", f"RSS at step {from_step} MiB", f"at step {steps} MiB", "growth", "bytes per step", "target < 1%"],
        [
            [
                r,
                f"{taken[from_step][r] / 1024:.1f}",
                f"{taken[steps][r] / 1024:.1f}",
                f"{growth[r] * 100:+.2f}%",
                f"{per_step[r]:.0f}",
                "met" if growth[r] < 0.01 else "MISSED",
            ]
            for r in ranks
        ],
    )
    print(table + "\n\n" + summary)
    if out_dir is not None:
        md = "\n".join(
            [
                *B.report_head("soak", B.machine(), before, B.load_average()),
                f"{steps + MARGIN} steps in {wall:.0f} s, 2 computing ranks (2 stages, 1 layer each, hidden 32)",
                "",
                summary,
                "",
                table,
            ]
        )
        payload = {
            "steps": steps,
            "from_step": from_step,
            "wall_s": wall,
            "machine": B.machine(),
            "rss_kib": {str(s): {str(r): v for r, v in taken[s].items()} for s in sorted(taken)},
            "growth": {str(r): g for r, g in growth.items()},
            "bytes_per_step": {str(r): v for r, v in per_step.items()},
        }
        B.write_results(out_dir, "soak", md + "\n", payload)


if __name__ == "__main__":
    main()
