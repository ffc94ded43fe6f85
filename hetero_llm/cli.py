"""``hetero-launch``: parse, load, call one library function, print."""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import click

from hetero_llm import checkpoint as checkpoint_mod, layout as layout_mod, outputs
from hetero_llm.errors import LayoutError, RankFailure


class _UsageLine(click.ClickException):
    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class OneLineCommand(click.Command):
    """A command whose usage errors (unknown flag, bad flag value, missing argument) are one line,
    ``error: ...`` with exit code 2, like every other bad input: no usage text."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as e:
            command = e.ctx.command_path if e.ctx is not None else info_name
            raise _UsageLine(f"{e.format_message().rstrip('.')} (see {command} --help)") from None


def version_option(command: str):
    """``--version``: print ``<command> <version>``, the package metadata's version (hetero_llm.__version__)."""
    import hetero_llm

    return click.version_option(hetero_llm.__version__, "--version", prog_name=command, message="%(prog)s %(version)s",
                                help="Print the command's name and hetero_llm's version, and exit.")


class WholeRange(click.IntRange):
    """``click.IntRange`` whose error for a word says "is not a valid integer", as ``type=int`` does."""

    name = "integer"


class FiniteFloatRange(click.FloatRange):
    """``click.FloatRange`` that also refuses nan and inf (which compare False with every bound, so pass it)."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


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
@click.option("--quiet", is_flag=True, help="No per-step progress lines.")
@click.option("--tensorboard", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Also write loss, valid_loss, lr and grad_norm as TensorBoard scalars into DIR (needs tensorboard).")
def main(layout_file, overrides, dry_run, node, rank, metrics_jsonl, checkpoint, checkpoint_every, resume, trace,
         quiet, tensorboard):
    """Train the model a LAYOUT.toml describes, on the ranks of this host."""
    from hetero_llm import dryrun, envlaunch, launch, optim_shards, params, rendezvous
    from hetero_llm.plan import compile_plan

    try:
        lay = layout_mod.load(layout_file, overrides)
        plan = compile_plan(lay)
        envlaunch.check_environment(os.environ, plan.world_size)  # OMP_NUM_THREADS, HETERO_*, MASTER_ADDR: one line
        rendezvous.endpoint(plan)  # a bad MASTER_PORT, or a master node without ranks: one line, before anything starts
        if rank is None and node is None and (given := envlaunch.assigned(os.environ)) is not None:
            envlaunch.check(plan, given)  # started by torchrun or srun: run the rank it gave this process
            rank = given.rank
        if resume == envlaunch.AUTO:
            resume = envlaunch.resume_auto(checkpoint, lay)  # the newest complete save, or None: start fresh
        if checkpoint_every and not checkpoint:
            raise LayoutError(lay.file, "--checkpoint-every", "needs --checkpoint DIR (the folder to save into)")
        # What the real run refuses, --dry-run refuses too; all of it before any rank starts.
        if rank is not None:
            launch.check_rank(plan, rank)
        elif node is not None or not dry_run:  # a dry run on a machine that is no node of the cluster is fine
            ranks = launch.local_ranks(plan, node)
        here = [rank] if rank is not None else ranks if node is not None or not dry_run else _ranks_here(plan)
        params.check_memory(plan, here)  # absurd sizes: one line, not a MemoryError in every rank
        outputs.check_run_paths(lay, metrics_jsonl, checkpoint, trace, resume)
        if resume:  # checked here, before any rank starts; every rank then reads the same step folder
            ckpt = checkpoint_mod.for_resume(resume, lay)
            if rank is None or not os.environ.get("HETERO_ERROR_DIR"):  # a launcher's rank: the launcher verified
                warning = checkpoint_mod.verify(ckpt)
                if warning:
                    click.echo(f"warning: {warning}", err=True)
            resume = str(ckpt.path)
        if tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise LayoutError(lay.file, "--tensorboard", "needs the tensorboard package (pip install tensorboard)")
        options = launch.RunOptions(tuple(overrides), metrics_jsonl, checkpoint, checkpoint_every, resume, trace, quiet,
                                    tensorboard)
        if dry_run and rank is not None:  # what this one rank will do (its RankPlan)
            click.echo(dryrun.describe_rank(plan.rank_plan(rank)))
            click.echo("\n" + rendezvous.describe(plan))
            return
        if dry_run:
            device = _emulated_device() if lay.buckets else None  # a bad one refused before anything is shown
            click.echo(dryrun.describe(plan))
            click.echo(rendezvous.describe(plan))
            if lay.train.optimizer is layout_mod.Optimizer.ADAMW_ZERO1:
                click.echo("\n" + optim_shards.describe(plan))
            if lay.buckets:
                from hetero_llm import bucket_sim, switch

                click.echo("\n" + switch.describe_buckets(lay, plan))
                click.echo(bucket_sim.describe_bucket_step(lay, device))
            return
        if rank is not None:
            if lay.data.path and not os.environ.get("HETERO_ERROR_DIR"):  # on its own: no launcher checked the file
                _checked_source(lay)
            launch.run_rank(plan, rank, options)
            return
        source = _checked_source(lay)  # tokenizes a text file once, before any rank starts
        if not quiet:
            click.echo(f"hetero-launch: starting {len(ranks)} of {plan.world_size} ranks here: {ranks}")
            if hasattr(source, "loss_floor"):
                click.echo(f"data: embedded grammar, loss floor {source.loss_floor(lay.model.seq_len):.4f} nats/token "
                           f"(uniform guess: {math.log(source.vocab_size):.4f})")
        launch.run_ranks(plan, ranks, options)
    except LayoutError as e:
        if rank is None or not os.environ.get("HETERO_ERROR_DIR"):  # a bad save found by a rank: the launcher says
            click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except RankFailure as e:
        if rank is None or not os.environ.get("HETERO_ERROR_DIR"):  # under the launcher, it reports
            click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo(launch.INTERRUPTED, err=True)
        sys.exit(130)


def _ranks_here(plan) -> list[int]:
    """The ranks of the nodes whose host is this machine (none: a dry run elsewhere)."""
    from hetero_llm import launch

    try:
        return launch.local_ranks(plan, None)
    except LayoutError:
        return []


def _emulated_device():
    """The modelled device of ``--dry-run``'s hot-switching prediction: ``HETERO_EMULATE_DEVICE``'s entry for
    every rank (``*``) or rank 0; None when it has none."""
    from hetero_llm.bucket_sim import EmulatedDevice

    spec = None
    for item in filter(None, os.environ.get("HETERO_EMULATE_DEVICE", "").split(",")):
        who, _, rest = item.partition(":")
        if who.strip() in ("*", "0"):
            spec = rest
    if spec is None:
        return None
    try:
        return EmulatedDevice.parse(spec)
    except ValueError as e:  # envlaunch.check_environment refused it already; kept for callers of its own
        example = "'*:gflops=100;tp_gbps=200;tp_latency_us=5'"
        raise LayoutError("environment", "HETERO_EMULATE_DEVICE", f"{e} (e.g. {example})") from None


def _checked_source(lay: layout_mod.Layout):
    """The layout's data source, refused now if it cannot give one window of text or holds ids outside
    model.vocab (rather than in every rank)."""
    from hetero_llm import data, textcache, tokenfiles

    source = data.make_source(lay.data, lay.file)
    if lay.data.packing is layout_mod.Packing.DOCUMENTS:  # whole documents, however short: found now, or why not
        from hetero_llm import evaluate

        evaluate.document_sources(lay.data, lay.model.seq_len, lay.file)  # and the held-out ones
    elif isinstance(source, textcache.TokenFileSource):
        source.require_text(lay.model.seq_len + 1)
    tokenfiles.check_vocab(source, lay.model.vocab, lay.file)
    return source


@click.command("hetero-place", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@version_option("hetero-place")
@click.argument("cluster_file", metavar="CLUSTER.toml", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out", required=True, type=click.Path(dir_okay=False),
              help="Write the placed layout here (the cluster file plus [[pipelines]]).")
@click.option("--pipelines", type=int, default=0, show_default="as many as the smallest domain allows",
              help="Data-parallel pipelines.")
@click.option("--tp", type=int, default=1, show_default=True, help="Devices per stage (inside one node).")
@click.option("--microbatches", type=int, default=0, show_default="2 x stages", help="Microbatches per pipeline.")
def place_main(cluster_file, out, pipelines, tp, microbatches):
    """Place a model on a cluster NIC-aware (Holmes): TP in a node, DP in a domain, stages across domains."""
    from hetero_llm import place

    try:
        outputs.check_output_file("--out", out, [("the cluster file", cluster_file)])
        placement = place.place_file(cluster_file, out, place.PlaceOptions(pipelines, tp, microbatches))
    except LayoutError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(place.report(placement))
    click.echo(f"\nwrote {out} (check it with: hetero-launch {out} --dry-run)")


if __name__ == "__main__":
    main()
