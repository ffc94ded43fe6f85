"""``python -m hetero_llm.timeline``: a --trace directory, or a simulated schedule, as a timeline PNG and/or a
Chrome trace (predict/timeline.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from hetero_llm._fs import write_atomically
from hetero_llm.cli.common import FiniteFloatRange, OneLineCommand, WholeRange, one_line_errors, version_option
from hetero_llm.errors import LayoutError, ScheduleError
from hetero_llm.launch import outputs
from hetero_llm.predict import trace as tracing
from hetero_llm.predict.timeline import plot_timeline, simulated


@click.command(
    "python -m hetero_llm.timeline", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]}
)
@version_option("python -m hetero_llm.timeline")
@click.argument("trace_dir", required=False, type=click.Path(file_okay=False))
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the timeline PNG here.")
@click.option(
    "--chrome",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a Chrome/Perfetto trace JSON here (open in ui.perfetto.dev).",
)
@click.option(
    "--step",
    type=int,
    default=None,
    help="Plot only this step of a measured trace (0-based; -1: the last). Default: all.",
)
@click.option("--title", default=None, help="Title of the PNG.")
@click.option("--simulate", "simulate_", is_flag=True, help="Simulate a schedule instead of reading a trace.")
@click.option("--stages", type=WholeRange(min=1), default=4, show_default=True, help="Simulated pipeline stages.")
@click.option("--microbatches", type=WholeRange(min=1), default=8, show_default=True, help="Simulated microbatches.")
@click.option(
    "--schedule",
    "kind",
    type=click.Choice(["gpipe", "1f1b", "interleaved", "zbh1"]),
    default="1f1b",
    show_default=True,
    help="Simulated schedule.",
)
@click.option(
    "--chunks", type=WholeRange(min=1), default=None, help="Model chunks per stage for --schedule interleaved [2]."
)
@click.option(
    "--schedule-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Simulate this schedule file (text or CSV; see schedule.load_schedule_file).",
)
@click.option(
    "--forward-ms", type=FiniteFloatRange(min=0), default=1.0, show_default=True, help="Simulated F time per stage."
)
@click.option(
    "--backward-ms", type=FiniteFloatRange(min=0), default=2.0, show_default=True, help="Simulated B time per stage."
)
@click.option(
    "--weight-ms",
    type=FiniteFloatRange(min=0),
    default=None,
    help="W part of --backward-ms where a schedule splits backwards into I and W [half of it].",
)
@click.option(
    "--latency-ms", type=FiniteFloatRange(min=0), default=0.0, show_default=True, help="Simulated p2p latency per link."
)
def main(
    trace_dir,
    out,
    chrome,
    step,
    title,
    simulate_,
    stages,
    microbatches,
    kind,
    chunks,
    schedule_file,
    forward_ms,
    backward_ms,
    weight_ms,
    latency_ms,
):
    """Merge a --trace directory (or simulate a schedule) into a timeline PNG and/or a Chrome trace."""
    with one_line_errors(ScheduleError, ValueError, FileNotFoundError):
        if not out and not chrome:
            raise ValueError("nothing to write: give --out PNG and/or --chrome JSON")
        if simulate_ == bool(trace_dir):
            raise ValueError("give either TRACE_DIR or --simulate (one of them)")
        if out and chrome and outputs.same_path(out, chrome):
            raise LayoutError(chrome, "--chrome", "is also the path of --out (give each output its own path)")
        inputs = [("--schedule-file", schedule_file)] if schedule_file else []
        for flag, path in (("--out", out), ("--chrome", chrome)):
            if path:
                outputs.check_output_file(flag, path, inputs)
        if simulate_:
            labels, rows, default_title, summary = simulated(
                stages, microbatches, kind, chunks, schedule_file, forward_ms, backward_ms, weight_ms, latency_ms
            )
            click.echo(summary)
            chrome_rows, process = rows, default_title
        else:
            labels, rows = tracing.rank_rows(tracing.read_rank_traces(trace_dir))
            chrome_rows, process = rows, f"trace {trace_dir}"
            default_title = f"trace {trace_dir}: {len(rows)} ranks"
            if step is not None:  # the Chrome trace keeps every step: it zooms
                rows = [_pick_step(tracing.split_steps(row), step, label) for row, label in zip(rows, labels)]
                default_title += ", last step" if step == -1 else f", step {step}"
        if chrome:
            Path(chrome).parent.mkdir(parents=True, exist_ok=True)
            events = json.dumps(tracing.chrome_events(labels, chrome_rows, process=process))
            write_atomically(Path(chrome), lambda f: f.write(events.encode()))
            click.echo(f"wrote {chrome} ({sum(len(r) for r in chrome_rows)} events, {len(labels)} rows)")
        if out:
            plot_timeline(rows, out, title if title is not None else default_title, labels=labels)
            click.echo(f"wrote {out}")


def _pick_step(steps: list, step: int, label: str) -> list:
    try:
        return steps[step]
    except IndexError:
        raise ValueError(f"{label}: no step {step} (the trace has {len(steps)} steps)") from None


if __name__ == "__main__":
    main()
