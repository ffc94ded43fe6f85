"""``hetero-launch``: parse, load, call one library function, print."""

from __future__ import annotations

import math

import click

from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint.folders import DEFAULT_KEEP
from hetero_llm.cli.common import OneLineCommand, one_line_errors, version_option
from hetero_llm.errors import LayoutError
from hetero_llm.launch import preflight


@click.command("hetero-launch", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@version_option("hetero-launch")
@click.argument("layout_file", metavar="LAYOUT.toml")
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a layout key, e.g. --set train.steps=5 (repeatable).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan counted: pipelines x stages, communicators by kind, buckets, schedules (with --full: "
    "every rank, communicator and schedule grid; with --rank R: what rank R does, its actions, routes, groups, "
    "shards and buckets); start nothing.",
)
@click.option(
    "--full",
    is_flag=True,
    help="With --dry-run: print every rank, communicator, gradient-sync bucket and schedule grid, and each "
    "rank's optimizer state (plain --dry-run counts them).",
)
@click.option("--node", default=None, help="Start only this node's ranks (default: every node whose host is local).")
@click.option(
    "--rank",
    type=int,
    default=None,
    help="Run exactly this one rank in this process (default under "
    "torchrun or srun: the rank they give it, from RANK or SLURM_PROCID).",
)
@click.option(
    "--metrics-jsonl",
    default=None,
    metavar="FILE",
    help="Write one JSON object per step (step, loss, lr, grad_norm, tokens, seconds).",
)
@click.option(
    "--checkpoint",
    default=None,
    metavar="DIR",
    help="Save parameters and AdamW state here, into DIR/step-NNNNNN (one shard file per rank, "
    "keyed by global names: any layout of the model can resume it).",
)
@click.option(
    "--checkpoint-every",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="Also save every N steps (default 0: at the end only).",
)
@click.option(
    "--keep-last",
    type=int,
    default=None,
    metavar="N",
    help="Keep the newest N complete saves in --checkpoint DIR, removing older ones (never the one resumed "
    f"from); with --elastic also the snapshots each rank keeps in node memory (default: {DEFAULT_KEEP} saves with "
    "--checkpoint-every, else every save; 2 snapshots).",
)
@click.option(
    "--resume",
    default=None,
    metavar="DIR",
    help="Continue from a checkpoint: a --checkpoint DIR (its newest complete save) or a step folder; "
    "'auto': the --checkpoint DIR's newest complete save if it has one, else start fresh.",
)
@click.option(
    "--trace", default=None, metavar="DIR", help="Record every action's start and end per rank into this directory."
)
@click.option("--quiet", is_flag=True, help="No per-step progress lines, no line per save, no progress bars.")
@click.option(
    "--tensorboard",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="Also write every number of --metrics-jsonl (loss, valid_loss, lr, grad_norm, tokens, seconds) and "
    "tokens_per_second as TensorBoard scalars train/NAME into DIR (needs tensorboard).",
)
@click.option(
    "--elastic",
    is_flag=True,
    help="LAYOUT.toml is a cluster file (no [[pipelines]]) listing every node the run may use; run under "
    "torchrun's elastic agent, one agent per node (--node NAME says which): every start and restart plans "
    "the layout for the nodes present and resumes from --checkpoint DIR (docs/elastic.md).",
)
@click.option(
    "--snapshot-every",
    type=click.IntRange(min=0),
    default=0,
    metavar="K",
    help="With --elastic: also snapshot every K steps into node memory ($HETERO_SHM_DIR or /dev/shm), written "
    "while the next steps compute; a restart resumes from the newest step whose every block has a holder when "
    "it is newer than --checkpoint DIR's newest save (docs/elastic.md).",
)
def main(**args):
    """Train the model a LAYOUT.toml describes, on the ranks of this host."""
    from hetero_llm.launch import node as launcher

    launcher.quiet_cpp_warnings()  # before anything imports torch
    with one_line_errors(interrupted=launcher.INTERRUPTED):
        _run(args)


def _run(args: dict) -> None:
    """What ``main`` runs: an elastic worker's round, a dry run, this process's rank, or this host's ranks."""
    from hetero_llm.launch import node as launcher

    file = args["layout_file"]
    if args.pop("elastic"):
        _elastic(args)
        return
    if args.pop("snapshot_every"):
        raise LayoutError(file, "--snapshot-every", "needs --elastic (snapshots are for restarts)")
    full = args.pop("full")
    if full and not args["dry_run"]:
        raise LayoutError(file, "--full", "needs --dry-run (it says what the dry run prints)")
    request = preflight.Request(**args | {"overrides": tuple(args["overrides"])})  # the options, by their names
    p = preflight.prepare(request, warn=lambda line: click.echo(f"warning: {line}", err=True))
    if request.dry_run:
        click.echo(_dry_run(p, full))
        return
    source = preflight.check_data(p)
    if p.rank is not None:
        launcher.run_rank(p.plan, p.rank, p.options)
        return
    assert p.ranks is not None  # neither a dry run nor a rank of its own: the ranks this node starts
    if not request.quiet:
        click.echo(f"hetero-launch: starting {len(p.ranks)} of {p.plan.world_size} ranks here: {p.ranks}")
        if hasattr(source, "loss_floor"):
            click.echo(
                f"data: embedded grammar, loss floor {source.loss_floor(p.layout.model.seq_len):.4f} "
                f"nats/token (uniform guess: {math.log(source.vocab_size):.4f})"
            )
    launcher.run_ranks(p.plan, p.ranks, p.options)


def _elastic(args: dict) -> None:
    """``--elastic``: this torchrun worker's round (launch/elastic.py); bad input, found before the round
    trains, also stops this worker's torchrun agent (no restart can fix it: ``launch/guards.py``)."""
    from hetero_llm.launch import guards

    with guards.refusal_ends_the_job():
        _elastic_round(args)


def _elastic_round(args: dict) -> None:
    """The options of an elastic worker, checked, and its round."""
    from hetero_llm.checkpoint import folders
    from hetero_llm.launch import elastic, elastic_worker
    from hetero_llm.train.options import RunOptions

    file = args["layout_file"]
    refused = {f"--{k.replace('_', '-')}": args[k] for k in ("overrides", "dry_run", "rank", "resume")}
    refused["--set"] = refused.pop("--overrides")
    elastic_worker.check_request(file, args["checkpoint"], refused)
    options = RunOptions(
        (),
        args["metrics_jsonl"],
        args["checkpoint"],
        args["checkpoint_every"],
        None,
        args["trace"],
        args["quiet"],
        args["tensorboard"],
        snapshot=(None, args["snapshot_every"]),
        keep_last=folders.keep_count(file, args["keep_last"], args["checkpoint_every"], args["checkpoint"]),
        keep_snapshots=args["keep_last"] or folders.SNAPSHOTS_KEPT,
    )
    elastic.run(file, args["node"], options)


def _dry_run(p: preflight.Prepared, full: bool) -> str:
    """What --dry-run prints: the plan counted (``full``: its rank table, communicators, schedules) and the
    rendezvous, or with --rank R what rank R does; the ZeRO-1 state and the hot-switching step where the layout
    has them."""
    from hetero_llm.comm import rendezvous
    from hetero_llm.plan import describe, zero1_slices
    from hetero_llm.runtime import emulation

    lay, plan = p.layout, p.plan
    if p.rank is not None:  # what this one rank will do (its RankPlan)
        return describe.describe_rank(plan.rank_plan(p.rank)) + "\n\n" + rendezvous.describe(plan)
    device = emulation.dry_run_device() if lay.buckets else None  # a bad one refused before anything is shown
    parts = [describe.describe(plan) if full else describe.summary(plan), rendezvous.describe(plan)]
    if lay.train.optimizer is layout_mod.Optimizer.ADAMW_ZERO1:
        parts.append("\n" + zero1_slices.describe(plan, full))
    if lay.buckets:
        from hetero_llm.switching import predict, transfers

        parts += ["\n" + transfers.describe_buckets(lay, plan), predict.describe_bucket_step(lay, device)]
    if not full:
        parts.append("\n" + describe.FULL_HINT)
    return "\n".join(parts)


if __name__ == "__main__":
    main()
