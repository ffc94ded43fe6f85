"""``hetero-launch``: parse, load, call one library function, print."""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import click

from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint import folders as checkpoint_folders
from hetero_llm.cli.common import OneLineCommand, version_option
from hetero_llm.errors import LayoutError, RankFailure
from hetero_llm.launch import preflight


@click.command("hetero-launch", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@version_option("hetero-launch")
@click.argument("layout_file", metavar="LAYOUT.toml")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a layout key, e.g. --set train.steps=5 (repeatable).")
@click.option("--dry-run", is_flag=True, help="Print the rank table, communicators and schedules (with --rank R: what "
              "rank R does, its actions, routes, groups, shards and buckets); start nothing.")
@click.option("--node", default=None, help="Start only this node's ranks (default: every node whose host is local).")
@click.option("--rank", type=int, default=None, help="Run exactly this one rank in this process (default under "
              "torchrun or srun: the rank they give it, from RANK or SLURM_PROCID).")
@click.option("--metrics-jsonl", default=None, metavar="FILE",
              help="Write one JSON object per step (step, loss, lr, grad_norm, tokens, seconds).")
@click.option("--checkpoint", default=None, metavar="DIR",
              help="Save parameters and AdamW state here, into DIR/step-NNNNNN (one shard file per rank, "
                   "keyed by global names: any layout of the model can resume it).")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=0, metavar="N",
              help="Also save every N steps (default 0: at the end only).")
@click.option("--resume", default=None, metavar="DIR",
              help="Continue from a checkpoint: a --checkpoint DIR (its newest complete save) or a step folder; "
                   "'auto': the --checkpoint DIR's newest complete save if it has one, else start fresh.")
@click.option("--trace", default=None, metavar="DIR",
              help="Record every action's start and end per rank into this directory.")
@click.option("--quiet", is_flag=True, help="No per-step progress lines, no line per save, no progress bars.")
@click.option("--tensorboard", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Also write every number of --metrics-jsonl (loss, valid_loss, lr, grad_norm, tokens, seconds) and "
                   "tokens_per_second as TensorBoard scalars train/NAME into DIR (needs tensorboard).")
def main(layout_file, overrides, dry_run, node, rank, metrics_jsonl, checkpoint, checkpoint_every, resume, trace,
         quiet, tensorboard):
    """Train the model a LAYOUT.toml describes, on the ranks of this host."""
    from hetero_llm.comm import rendezvous
    from hetero_llm.launch import external, memory, node as launcher
    from hetero_llm.plan import compile_plan, describe, zero1_slices
    from hetero_llm.runtime import emulation

    try:
        lay = preflight.load_layout(layout_file, overrides)
        plan = compile_plan(lay)
        external.check_environment(os.environ, plan.world_size)  # OMP_NUM_THREADS, HETERO_*, MASTER_ADDR: one line
        rendezvous.endpoint(plan)  # a bad MASTER_PORT, or a master node without ranks: one line, before anything starts
        if rank is None and node is None and (given := external.assigned(os.environ)) is not None:
            external.check(plan, given)  # started by torchrun or srun: run the rank it gave this process
            rank = given.rank
        if resume == external.AUTO:
            resume = external.resume_auto(checkpoint, lay)  # the newest complete save, or None: start fresh
        if checkpoint_every and not checkpoint:
            raise LayoutError(lay.file, "--checkpoint-every", "needs --checkpoint DIR (the folder to save into)")
        # What the real run refuses, --dry-run refuses too; all of it before any rank starts.
        if rank is not None:
            launcher.check_rank(plan, rank)
        elif node is not None or not dry_run:  # a dry run on a machine that is no node of the cluster is fine
            ranks = launcher.local_ranks(plan, node)
        here = [rank] if rank is not None else ranks if node is not None or not dry_run else _ranks_here(plan)
        memory.check_memory(plan, here)  # absurd sizes: one line, not a MemoryError in every rank
        preflight.check_run_paths(lay, metrics_jsonl, checkpoint, trace, resume, tensorboard)
        if resume:  # checked here, before any rank starts; every rank then reads the same step folder
            ckpt = checkpoint_folders.for_resume(resume, lay)
            if rank is None or not os.environ.get("HETERO_ERROR_DIR"):  # a launcher's rank: the launcher verified
                warning = checkpoint_folders.verify(ckpt, progress=not quiet)
                if warning:
                    click.echo(f"warning: {warning}", err=True)
            resume = str(ckpt.path)
        if tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise LayoutError(lay.file, "--tensorboard", "needs the tensorboard package (pip install tensorboard)")
        options = launcher.RunOptions(tuple(overrides), metrics_jsonl, checkpoint, checkpoint_every, resume, trace,
                                        quiet, tensorboard)
        if dry_run and rank is not None:  # what this one rank will do (its RankPlan)
            click.echo(describe.describe_rank(plan.rank_plan(rank)))
            click.echo("\n" + rendezvous.describe(plan))
            return
        if dry_run:
            device = emulation.dry_run_device() if lay.buckets else None  # a bad one refused before anything is shown
            click.echo(describe.describe(plan))
            click.echo(rendezvous.describe(plan))
            if lay.train.optimizer is layout_mod.Optimizer.ADAMW_ZERO1:
                click.echo("\n" + zero1_slices.describe(plan))
            if lay.buckets:
                from hetero_llm.switching import predict, transfers

                click.echo("\n" + transfers.describe_buckets(lay, plan))
                click.echo(predict.describe_bucket_step(lay, device))
            return
        if rank is not None:
            if lay.data.path and not os.environ.get("HETERO_ERROR_DIR"):  # on its own: no launcher checked the file
                preflight.checked_source(lay)
            launcher.run_rank(plan, rank, options)
            return
        source = preflight.checked_source(lay)  # tokenizes a text file once, before any rank starts
        preflight.check_init_weights(lay, resume)
        if not quiet:
            click.echo(f"hetero-launch: starting {len(ranks)} of {plan.world_size} ranks here: {ranks}")
            if hasattr(source, "loss_floor"):
                click.echo(f"data: embedded grammar, loss floor {source.loss_floor(lay.model.seq_len):.4f} nats/token "
                           f"(uniform guess: {math.log(source.vocab_size):.4f})")
        launcher.run_ranks(plan, ranks, options)
    except LayoutError as e:
        if rank is None or not os.environ.get("HETERO_ERROR_DIR"):  # a bad save found by a rank: the launcher says
            click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except RankFailure as e:
        if rank is None or not os.environ.get("HETERO_ERROR_DIR"):  # under the launcher, it reports
            click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo(launcher.INTERRUPTED, err=True)
        sys.exit(130)


def _ranks_here(plan) -> list[int]:
    """The ranks of the nodes whose host is this machine (none: a dry run elsewhere)."""
    from hetero_llm.launch import node as launcher

    try:
        return launcher.local_ranks(plan, None)
    except LayoutError:
        return []


if __name__ == "__main__":
    main()
