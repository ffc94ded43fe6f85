"""What a training run reports, on its reporting rank: one record per step (``StepMetrics``) to the console,
a JSONL file and TensorBoard (``Reporter``), and a line when it resumes and when it saves."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import attrs

from hetero_llm._fs import write_atomically

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


@attrs.frozen
class StepMetrics:
    step: int  # optimizer steps taken, counting this one (1 for the first step), as the console and checkpoints count
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    seconds: float
    valid_loss: float | None = None  # the held-out loss after this step, on steps that evaluate (train.eval_every)

    def json(self) -> str:
        return json.dumps({k: v for k, v in attrs.asdict(self).items() if v is not None})


@attrs.define
class Progress:
    """Console progress on the reporting rank: step, loss, tokens/s, ETA."""

    total: int
    first: int = 0  # the step this run starts at (a resumed run's ETA counts only its own steps)
    out: TextIO = sys.stdout
    started: float = attrs.field(factory=time.perf_counter)
    tokens: int = 0

    def update(self, m: StepMetrics) -> None:
        self.tokens += m.tokens
        elapsed = time.perf_counter() - self.started
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        eta = elapsed / (m.step - self.first) * (self.total - m.step)
        valid = f" | valid {m.valid_loss:.4f}" if m.valid_loss is not None else ""
        print(
            f"step {m.step:>5}/{self.total} | loss {m.loss:.4f}{valid} | lr {m.lr:.2e} | grad_norm {m.grad_norm:.3f} "
            f"| {rate / 1e3:.1f}k tok/s | ETA {duration(eta)}",
            file=self.out,
            flush=True,
        )


def duration(seconds: float) -> str:
    """``01:02:03`` under a day, ``3d 01:02:03`` beyond; ``>9999d`` past that (an absurd train.steps, or inf)."""
    if not seconds < 10_000 * 86400:
        return ">9999d"
    s = int(seconds)
    clock = f"{s // 3600 % 24:02d}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 86400}d {clock}" if s >= 86400 else clock


def tensorboard_scalars(m: StepMetrics) -> dict[str, float]:
    """What ``--tensorboard`` writes of a step (as ``train/<name>`` at step ``m.step``): every number of its
    ``--metrics-jsonl`` record but the step, and the throughput, tokens_per_second (tokens / seconds)."""
    values = {k: v for k, v in json.loads(m.json()).items() if k != "step"}
    values["tokens_per_second"] = m.tokens / m.seconds if m.seconds > 0 else 0.0
    return values


def summary_writer(directory: str) -> SummaryWriter:
    """A TensorBoard writer (the CLI checked that tensorboard is installed); steps counted as in the JSONL."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(directory)


def open_metrics(path: str, first_step: int) -> int:
    """Open the metrics file for writing. A resumed run keeps the records of the steps before it and drops
    later ones: a run that crashed after its last save trained those steps, and they are trained again."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if first_step and p.exists():
        # The kept records are replaced whole (a restart killed here, as an elastic run's may be, loses none),
        # then appended to.
        kept = [line for line in p.read_text().splitlines() if json.loads(line)["step"] <= first_step]
        write_atomically(p, lambda f: f.write("".join(line + "\n" for line in kept).encode()))
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)  # never through a link
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)


def append_line(fd: int, line: str) -> None:
    # One write() per whole line: a crash never leaves a half-written record behind a complete one.
    os.write(fd, (line + "\n").encode())


@attrs.define
class Reporter:
    """Every sink of a run's records on the reporting rank (the others report nothing): the console
    (``Progress`` every ``log_every`` steps, the first and last, and every held-out loss; a line per resume
    and per save), ``--metrics-jsonl`` (a line per step) and ``--tensorboard`` (every number of the line)."""

    total: int  # train.steps
    first: int  # the step this run starts at
    log_every: int
    progress: Progress | None = None
    metrics_file: int | None = None
    scalars: SummaryWriter | None = None

    @classmethod
    def open(
        cls,
        reporting: bool,
        quiet: bool,
        total: int,
        first: int,
        log_every: int,
        metrics_path: str | None,
        tensorboard: str | None,
    ) -> Reporter:
        return cls(
            total,
            first,
            log_every,
            Progress(total, first) if reporting and not quiet else None,
            open_metrics(metrics_path, first) if reporting and metrics_path else None,
            summary_writer(tensorboard) if reporting and tensorboard else None,
        )

    @property
    def console(self) -> bool:
        return self.progress is not None

    def record(self, m: StepMetrics) -> None:
        if self.metrics_file is not None:
            append_line(self.metrics_file, m.json())
        if self.scalars is not None:
            for tag, value in tensorboard_scalars(m).items():
                self.scalars.add_scalar(f"train/{tag}", value, m.step)
        if self.progress is None:
            return
        if m.step % self.log_every == 0 or m.step in (self.first + 1, self.total) or m.valid_loss is not None:
            self.progress.update(m)
        else:
            self.progress.tokens += m.tokens

    def say(self, line: str) -> None:
        """A line on the console (resumed from, saved to), unless quiet or not the reporting rank."""
        if self.console:
            print(line, flush=True)

    def close(self) -> None:
        if self.metrics_file is not None:
            os.close(self.metrics_file)
        if self.scalars is not None:
            self.scalars.close()
