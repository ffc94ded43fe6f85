"""Wall time of a whole ``hetero-launch`` of a 12-rank layout on this machine (startup dominates at this size).

The layout is the tests' TP [[4], [2, 2], [1, 1, 1, 1]]: three pipelines, 12 ranks, the reference model, 3 steps.
With ``--tree DIR`` (repeatable) the same launch also runs from other source trees (e.g. a ``git
worktree`` of an older commit), interleaved with this one, so they meet the same load:

    python -m bench.launch.launch_time --reps 4
    git worktree add /tmp/wt-exec 67032ca && python -m bench.launch.launch_time --tree /tmp/wt-exec   # before the fork
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import click

from bench.common import benchlib as B
from hetero_llm import layout as L

# (batch, microbatches, [(layers, TP size)]): 4 + 4 + 4 ranks
PIPELINES = [(6, 3, [(6, 4)]), (4, 2, [(3, 2), (3, 2)]), (2, 2, [(1, 1), (2, 1), (2, 1), (1, 1)])]


def launch_layout(file: str) -> L.Layout:
    """The reference model (Llama-style, 6 layers), PIPELINES' stages on one node's CPU devices in order."""
    model = L.ModelSpec(
        layers=6,
        hidden=32,
        heads=4,
        vocab=64,
        seq_len=16,
        norm=L.Norm.RMSNORM,
        position=L.Position.ROPE,
        mlp=L.Mlp.SWIGLU,
    )
    train = L.TrainSpec(steps=3, global_batch=12, seed=7, schedule=L.Schedule.GPIPE)
    pipelines, device = [], 0
    for batch, microbatches, stages in PIPELINES:
        specs = []
        for layers, tp in stages:
            specs.append(L.StageSpec(layers=layers, devices=tuple(f"n0:{device + i}" for i in range(tp))))
            device += tp
        pipelines.append(L.PipelineSpec(batch=batch, microbatches=microbatches, stages=tuple(specs)))
    cluster = L.ClusterSpec(nodes=(L.NodeSpec(name="n0", devices=("cpu",) * device),))
    return L.Layout(file=file, model=model, train=train, data=L.DataSpec(), cluster=cluster, pipelines=tuple(pipelines))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--tree",
    "trees",
    multiple=True,
    type=click.Path(file_okay=False, exists=True),
    help="Another source tree to time the same launch from (repeatable).",
)
@click.option("--reps", default=4, show_default=True)
@click.option("--quick", is_flag=True, help="One repetition.")
@click.option(
    "--out-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Also write launch_time.md there."
)
def main(trees, reps, quick, out_dir):
    """Median wall seconds of the same 12-rank hetero-launch from each source tree."""
    reps = 1 if quick else reps
    tmp = tempfile.TemporaryDirectory(prefix="bench_launch_")
    layout = Path(tmp.name, "layout.toml")
    L.dump(launch_layout(str(layout)), layout)
    sources = [str(B.ROOT), *trees]
    times: dict[str, list[float]] = {s: [] for s in sources}
    before = B.load_average()
    for rep in range(reps):
        for src in sources if rep % 2 == 0 else sources[::-1]:
            t0 = time.perf_counter()
            subprocess.run(B.launch_command(layout, port=B.free_port()), check=True, cwd=src, env=B.clean_env())
            times[src].append(time.perf_counter() - t0)
            B.say(f"rep {rep + 1}/{reps} {src}: {times[src][-1]:.1f} s (load {B.load_average()[0]:.2f})")
    rows = [[src, " / ".join(f"{t:.1f}" for t in ts), f"{statistics.median(ts):.1f}"] for src, ts in times.items()]
    table = B.markdown_table(["source tree", "wall s per launch", "median s"], rows)
    print(table)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        md = "\n".join([*B.report_head("launch_time", B.machine(), before, B.load_average()), table])
        (out_dir / "launch_time.md").write_text(md + "\n")
    tmp.cleanup()


if __name__ == "__main__":
    main()
