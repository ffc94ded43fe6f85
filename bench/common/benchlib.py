"""Shared pieces of the benchmark scripts: layouts, launching, timing statistics, result files, gloo's p2p cost.

Scripts in this folder import it as ``from bench.common import benchlib`` (they run as ``python -m bench.NAME``
from the repository root). Nothing here is part of the library: it drives ``hetero-launch`` as a user
would, in subprocesses, and reads back what the library writes (``--metrics-jsonl``; the ``--trace``
folders are read by ``bench/common/traces.py``). The paired comparison's driver is ``bench/pipeline/paired.py``.

Measurement rules every script follows (the machine is small and shared):

- A/B comparisons are measured in one run, with repetitions interleaved A, B, A, B, ... so a
  change in background load hits both sides alike; each side's number is the median over its
  repetitions, and each repetition's number is the median over the steps after the warm-up steps.
- The load average (``os.getloadavg``) is recorded before and after and published with the table.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def say(message: str) -> None:
    """One progress line, flushed at once (the scripts run for minutes)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------------------------------
# The machine


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def machine() -> dict:
    """What the numbers were measured on: CPU model and count, Python and torch versions."""
    from importlib.metadata import version

    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "platform": platform.platform(),
        "git": git_state(),
    }


def git_state() -> str:
    """The commit the library was measured at, ``+dirty`` when the working tree had changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "hetero_llm"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def machine_line(info: dict) -> str:
    return (
        f"{info['cores']}-core CPU ({info['cpu']}), Python {info['python']}, torch {info['torch']}, "
        f"hetero_llm at {info.get('git', 'unknown')}"
    )


def load_line(before: Sequence[float], after: Sequence[float]) -> str:
    return (
        f"load average (1/5/15 min) {before[0]:.2f}/{before[1]:.2f}/{before[2]:.2f} before, "
        f"{after[0]:.2f}/{after[1]:.2f}/{after[2]:.2f} after"
    )


def report_head(name: str, info: dict, before: Sequence[float], after: Sequence[float]) -> list[str]:
    """The first lines of a results file: its title, the command that made it, the machine and its load."""
    return [f"# {name}", "", f"`{command_line()}`", "", machine_line(info) + "; " + load_line(before, after), ""]


# ------------------------------------------------------------------------------------------
# Layouts


@attrs.frozen
class ModelConfig:
    """The [model] and [train] keys the benchmarks vary (the rest are the library's defaults)."""

    layers: int = 8
    hidden: int = 128
    heads: int = 4
    vocab: int = 256
    seq_len: int = 128
    global_batch: int = 16
    steps: int = 12
    seed: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def layout_toml(
    cfg: ModelConfig, stage_layers: Sequence[int], microbatches: int, schedule: str, *, chunks: int = 1
) -> str:
    """One pipeline, one stage per CPU process, GPT-style model (LayerNorm, learned positions, GELU)."""
    from hetero_llm import layout

    if sum(stage_layers) != cfg.layers:
        raise ValueError(f"stage layers {list(stage_layers)} do not sum to {cfg.layers}")
    sched = layout.Schedule(schedule)
    model = layout.ModelSpec(
        layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, vocab=cfg.vocab, seq_len=cfg.seq_len
    )
    train = layout.TrainSpec(
        steps=cfg.steps,
        global_batch=cfg.global_batch,
        seed=cfg.seed,
        schedule=sched,
        chunks=chunks if sched is layout.Schedule.INTERLEAVED else 1,
        lr=1e-3,
        min_lr=1e-4,
        warmup_steps=2,
        weight_decay=0.1,
        log_every=1,
    )
    cluster = layout.ClusterSpec(
        nodes=(layout.NodeSpec(name="node0", devices=("cpu",) * len(stage_layers)),), timeout_s=120.0
    )
    stages = tuple(layout.StageSpec(layers=n, devices=(f"node0:{i}",)) for i, n in enumerate(stage_layers))
    pipeline = layout.PipelineSpec(batch=cfg.global_batch, microbatches=microbatches, stages=stages)
    return layout.dumps(
        layout.Layout(
            file="<bench>",
            model=model,
            train=train,
            data=layout.DataSpec(kind=layout.DataKind.GRAMMAR),
            cluster=cluster,
            pipelines=(pipeline,),
        )
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# rendezvous and emulation variables a launch must not inherit from this process (a bench sets them per run)
DROP_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "HETERO_EMULATE_SLOWDOWN",
    "HETERO_EMULATE_JITTER",
    "HETERO_EMULATE_ACTION_S",
    "HETERO_EMULATE_DEVICE",
)


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without rendezvous or emulation variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in DROP_ENV}
    env.update(extra or {})
    return env


def launch_command(
    layout: str | os.PathLike,
    *,
    metrics: str | os.PathLike | None = None,
    sets: Sequence[str] = (),
    port: int | None = None,
    node: str | None = None,
    trace: str | os.PathLike | None = None,
    quiet: bool = True,
    args: Sequence[str] = (),
    python: str | None = sys.executable,
) -> list[str]:
    """The ``hetero-launch LAYOUT ...`` command line of every bench that starts one itself (the testbed's per-node
    launches, torchrun's agents, the launch-time and soak runs): this interpreter, ``-m hetero_llm.cli``, the layout,
    ``--node``, ``--quiet``, ``--metrics-jsonl``, ``--trace``, ``args``, then each ``--set`` (``port``: one more,
    ``cluster.port=PORT``). ``python`` None: from ``-m`` on (what torchrun is given). Runs measured to completion
    on one machine go through ``launch_layout`` (``hetero_llm.api.run``, the sweep runner's launch) instead."""
    cmd = [*((python,) if python is not None else ()), "-m", "hetero_llm.cli", str(layout)]
    cmd += ["--node", node] if node is not None else []
    cmd += ["--quiet"] if quiet else []
    cmd += ["--metrics-jsonl", str(metrics)] if metrics is not None else []
    cmd += ["--trace", str(trace)] if trace is not None else []
    cmd += list(args)
    for item in (*sets, *((f"cluster.port={port}",) if port is not None else ())):
        cmd += ["--set", item]
    return cmd


@attrs.frozen
class Launch:
    """One finished ``hetero-launch`` run."""

    rows: list[dict]  # --metrics-jsonl, one dict per step
    cpu_s: float  # user + system CPU seconds of the launcher and all its ranks (startup included)
    wall_s: float


def run_layout(
    layout: Path, workdir: Path, *, env: dict[str, str] | None = None, trace: Path | None = None, timeout: float = 600
) -> list[dict]:
    """``hetero-launch LAYOUT --quiet --metrics-jsonl ...`` to completion; the per-step metrics rows."""
    return launch_layout(layout, workdir, env=env, trace=trace, timeout=timeout).rows


def launch_layout(
    layout: Path,
    workdir: Path,
    *,
    env: dict[str, str] | None = None,
    trace: Path | None = None,
    timeout: float = 600,
    checkpoint: str | None = None,
) -> Launch:
    """``hetero-launch LAYOUT --quiet --metrics-jsonl WORKDIR/metrics.jsonl`` to completion, with its CPU and wall
    time: one point of the sweep runner (``hetero_llm.api.run``: its own port, process group and timeout; stdout and
    stderr in WORKDIR), with this process's environment less ``DROP_ENV``, plus ``env``. A failed run raises."""
    from hetero_llm import api

    args = ["--trace", str(trace)] if trace is not None else []
    args += ["--checkpoint", checkpoint, "--checkpoint-every", "1"] if checkpoint is not None else []  # a save a step
    held = {k: os.environ.pop(k) for k in DROP_ENV if k in os.environ}  # api.run passes os.environ on
    try:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        run = api.run(layout, workdir, timeout_s=timeout, env=env, args=args)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        os.environ.update(held)
    if not run.ok:
        out = {name: Path(workdir, name).read_text(errors="replace")[-4000:] for name in ("stdout.txt", "stderr.txt")}
        raise RuntimeError(
            f"hetero-launch {layout} {run.status} ({run.exit_code}): {run.error}\n{out['stdout.txt']}\n"
            f"{out['stderr.txt']}"
        )
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Launch([dict(row) for row in run.steps], cpu, run.wall_s)


def rank_script_args(parser, child) -> object | None:
    """Parse a benchmark script's arguments, adding ``--child OUT``: the mode ``start_ranks`` re-enters the
    script in (``python -m bench.NAME --child OUT -- LAYOUT ... --rank R``), which runs ``child(OUT, argv after
    --)`` and returns None; otherwise the parsed arguments."""
    import argparse

    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        child(args.child, rest[rest.index("--") + 1 :])  # start_ranks appends --rank R
        return None
    return args


def start_ranks(
    module: str, args: list[str], world: int, *, env: dict[str, str] | None = None, timeout: float = 900
) -> None:
    """One ``python -m MODULE ARGS --rank R`` process per rank (in the repository root), to completion; raise on
    the first failure.

    Each gets the threads ``hetero-launch`` gives a local rank (``launch.node_threads``) unless
    ``OMP_NUM_THREADS`` is set.
    """
    from hetero_llm.launch.node import node_threads

    extra = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(node_threads(world)))}
    full_env = clean_env({**extra, **(env or {})})
    procs, logs = [], []
    try:
        for rank in range(world):
            cmd = [sys.executable, "-m", module, *args, "--rank", str(rank)]
            logs.append(tempfile.TemporaryFile("w+"))  # a pipe nobody reads could fill and stall the rank
            procs.append(
                subprocess.Popen(cmd, env=full_env, stdout=logs[-1], stderr=subprocess.STDOUT, text=True, cwd=ROOT)
            )
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if bad:
        rank, code = bad[0]
        raise RuntimeError(f"{module} rank {rank} failed ({code}):\n{outputs[rank]}")


# ------------------------------------------------------------------------------------------
# Statistics


def steady(values: Sequence[float], skip: int) -> list[float]:
    """The values after the first ``skip`` warm-up steps (all of them if too few)."""
    return list(values[skip:]) if len(values) > skip else list(values)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def tokens_per_second(step_seconds: Sequence[float], tokens_per_step: int, skip: int) -> float:
    """Tokens per step over the median step time after ``skip`` warm-up steps."""
    return tokens_per_step / median(steady(step_seconds, skip))


# ------------------------------------------------------------------------------------------
# Output


def fmt(value, digits: int = 3) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


def plot_pair_bars(
    results: list[dict],
    sides: tuple[tuple[str, str], ...],
    label,
    path: Path,
    title: str,
    note=lambda r: f"{r['ratio']:.2f}x",
) -> None:
    """Bars of ``r[f"{side}_tokens_s"]`` for each (side, colour), one group per result row, ``note(r)`` above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.6), dpi=120)
    w = 0.8 / len(sides)
    x = range(len(results))
    for j, (side, color) in enumerate(sides):
        ax.bar(
            [i + (j - (len(sides) - 1) / 2) * w for i in x],
            [r[f"{side}_tokens_s"] for r in results],
            w,
            label=side,
            color=color,
        )
    top = max(r[f"{side}_tokens_s"] for r in results for side, _ in sides)
    for i, r in enumerate(results):
        ax.text(i, top * 1.03, note(r), ha="center", fontsize=8)
    ax.set_xticks(list(x), [label(r) for r in results])
    ax.set_ylabel("tokens / s (median)")
    ax.set_ylim(0, top * 1.2)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_results(out_dir: Path, name: str, markdown: str, payload: dict) -> tuple[Path, Path]:
    """``out_dir/name.md`` (the table and its context) and ``out_dir/name.json`` (every number)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / f"{name}.md", out_dir / f"{name}.json"
    md.write_text(markdown.rstrip() + "\n")
    js.write_text(json.dumps(payload, indent=1) + "\n")
    return md, js


def command_line() -> str:
    """How this script was started, for the results file: ``python -m bench.NAME ARGS``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # set by python -m
    if spec is None or not spec.name:
        return " ".join(["python", *sys.argv])
    return " ".join(["python", "-m", spec.name, *sys.argv[1:]])


# ------------------------------------------------------------------------------------------
# Point-to-point cost of gloo on this host


def _p2p_rank(rank: int, port: int, sizes: list[int], reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    result = {}
    for n in sizes:
        buf = torch.zeros(n)
        times = []
        for i in range(reps + 5):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i >= 5:
                times.append(time.perf_counter() - t0)
        result[n] = statistics.median(times) / 2  # one way
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def p2p_probe(reps: int = 50, big: int = 1 << 20, *, fork: bool = False) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of one gloo send between two processes here, from ping-pongs of
    a 1-element and a ``big``-element float32 tensor (median one-way times; 4 MB by default, so
    the bandwidth term is well above the timing noise of a busy host). ``fork``: the two processes are
    forks of this one rather than fresh interpreters (no second torch import: the ``--quick`` runs)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "p2p.json"))
        mp.start_processes(
            _p2p_rank, args=(free_port(), [1, big], reps, out), nprocs=2, start_method="fork" if fork else "spawn"
        )
        times = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    latency = times[1]
    extra = max(times[big] - latency, 1e-9)
    return latency, 4 * (big - 1) / extra
