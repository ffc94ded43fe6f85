"""``hetero-sweep SPEC.toml`` and ``hetero-sweep merge SPEC.toml``: parse, call hetero_llm.sweep, print."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hetero_llm.cli.common import OneLineCommand, one_line_errors, version_option
from hetero_llm.errors import LayoutError

SETTINGS = {"help_option_names": ["-h", "--help"]}


def default_out(spec_file: str) -> Path:
    """``NAME-sweep`` in the current folder for ``NAME.toml``: the same command finds its results again."""
    return Path(f"{Path(spec_file).stem}-sweep")


@click.command("hetero-sweep", cls=OneLineCommand, context_settings=SETTINGS)
@version_option("hetero-sweep")
@click.argument("spec_file", metavar="SPEC.toml")
@click.option(
    "-o",
    "--out",
    default=None,
    metavar="DIR",
    help="The results folder (default: NAME-sweep here for NAME.toml; with --shard I/N, its shard-I-of-N).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Validate and predict every point and print them; run nothing (a cluster file as the base is still planned).",
)
@click.option(
    "--shard",
    "shard_spec",
    default=None,
    metavar="I/N",
    help="Run only the points whose index is I modulo N (0 <= I < N: a SLURM job array's task id); "
    "join the slices with hetero-sweep merge.",
)
@click.option(
    "--retry-failed", is_flag=True, help="Run again the points an earlier call recorded as failed or timed out."
)
def sweep_command(spec_file, out, dry_run, shard_spec, retry_failed):
    """Sweep a layout's keys: every point validated and predicted first, then (mode run or both) trained, each in
    a launch of its own; resumable (rerun the same command), reported as a table, the best layout and plots."""
    from hetero_llm import sweep

    if out is None:
        out = default_out(spec_file)
        if shard_spec is not None:
            out = out / f"shard-{shard_spec.replace('/', '-of-')}"
    with one_line_errors(interrupted="hetero-sweep: interrupted (rerun the same command to resume)"):
        if Path(out).exists() and not Path(out).is_dir():
            raise LayoutError(str(out), "--out", "is a file (name a folder for the results)")
        sweep.sweep(spec_file, out, shard_spec=shard_spec, dry_run=dry_run, retry_failed=retry_failed, say=click.echo)


@click.command("hetero-sweep merge", cls=OneLineCommand, context_settings=SETTINGS)
@click.argument("spec_file", metavar="SPEC.toml")
@click.argument("slices", nargs=-1, metavar="[SLICE_DIR]...")
@click.option("-o", "--out", default=None, metavar="DIR", help="Where the joined results go (default: NAME-sweep).")
def merge_command(spec_file, slices, out):
    """Join the results of a sharded sweep's slices (default: every shard-* folder of the results folder) and
    report the whole sweep."""
    from hetero_llm import sweep

    out = Path(out) if out is not None else default_out(spec_file)
    found = [Path(s) for s in slices] or sorted(out.glob("shard-*-of-*"))
    with one_line_errors():
        sweep.merge(spec_file, out, found, say=click.echo)


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["merge"]:
        merge_command.main(argv[1:], prog_name="hetero-sweep merge")
    else:
        sweep_command.main(argv, prog_name="hetero-sweep")


if __name__ == "__main__":
    main()
