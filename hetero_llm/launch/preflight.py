"""Every check a run makes before any rank starts, so that a bad input is one line, not a failure in every rank.

``prepare`` runs them in order for ``hetero-launch``'s arguments (the command line only parses): the layout
and the files it names (``load_layout``), the compiled plan, the environment, the rendezvous endpoint, the
rank this process runs under torchrun or srun, the ranks this host starts, their memory, the output paths
(launch/outputs.py), the save to resume from, TensorBoard, and last the rendezvous port of a rank run in this
process (free, where it serves the store; ``node.run_ranks`` checks the port of the ranks it starts after the
data: another program on the port is no reason to hide a mistake in what the user gave). ``check_data`` then
reads the data (a text file is tokenized once, here, not in every rank) and ``model.init_from``'s weights.
``--dry-run`` refuses what the real run would refuse, before it prints anything. Torch-free.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import attrs

from hetero_llm import layout as layout_mod
from hetero_llm.checkpoint import folders as checkpoint_folders
from hetero_llm.comm import rendezvous
from hetero_llm.errors import LayoutError
from hetero_llm.launch import external, memory, outputs
from hetero_llm.launch import node as launcher
from hetero_llm.layout import Layout
from hetero_llm.plan import Plan, compile_plan
from hetero_llm.train.options import RunOptions


@attrs.frozen
class Request:
    """What ``hetero-launch`` was asked (its arguments, as parsed)."""

    layout_file: str
    overrides: tuple[str, ...] = ()
    dry_run: bool = False
    node: str | None = None
    rank: int | None = None
    metrics_jsonl: str | None = None
    checkpoint: str | None = None
    checkpoint_every: int = 0
    keep_last: int | None = None
    resume: str | None = None
    trace: str | None = None
    quiet: bool = False
    tensorboard: str | None = None


@attrs.frozen
class Prepared:
    """A run that passed every check: its layout and plan, this process's rank (``--rank``, torchrun, srun) or
    the ranks it starts (none for a dry run on a machine that is no node), and the options the ranks get."""

    layout: Layout
    plan: Plan
    rank: int | None
    ranks: list[int] | None
    options: RunOptions


def prepare(req: Request, warn: Callable[[str], None]) -> Prepared:
    """Every check before a rank starts, in the order their messages take precedence; ``warn`` gets warnings
    (a save without checksums). Raises a located ``LayoutError`` for the first problem."""
    lay = load_layout(req.layout_file, req.overrides)
    plan = compile_plan(lay)
    external.check_environment(os.environ, plan.world_size)  # OMP_NUM_THREADS, HETERO_*, MASTER_ADDR: one line
    rendezvous.endpoint(plan)  # a bad MASTER_PORT, or a master node without ranks: one line, before anything starts
    rank, resume = req.rank, req.resume
    if rank is None and req.node is None and (given := external.assigned(os.environ)) is not None:
        external.check(plan, given)  # started by torchrun or srun: run the rank it gave this process
        rank = given.rank
    if resume == external.AUTO:
        resume = external.resume_auto(req.checkpoint, lay)  # the newest complete save, or None: start fresh
    if req.checkpoint_every and not req.checkpoint:
        raise LayoutError(lay.file, "--checkpoint-every", "needs --checkpoint DIR (the folder to save into)")
    keep = checkpoint_folders.keep_count(lay.file, req.keep_last, req.checkpoint_every, req.checkpoint)
    ranks = None
    if rank is not None:
        launcher.check_rank(plan, rank)
    elif req.node is not None or not req.dry_run:  # a dry run on a machine that is no node of the cluster is fine
        ranks = launcher.local_ranks(plan, req.node)
    here = [rank] if rank is not None else ranks if ranks is not None else _ranks_here(plan)
    memory.check_memory(plan, here)  # absurd sizes: one line, not a MemoryError in every rank
    outputs.check_run_paths(lay, req.metrics_jsonl, req.checkpoint, req.trace, resume, req.tensorboard)
    if resume:  # checked here, before any rank starts; every rank then reads the same step folder
        ckpt = checkpoint_folders.for_resume(resume, lay)
        warning = checkpoint_folders.verify(ckpt, progress=not req.quiet)
        if warning:
            warn(warning)
        resume = str(ckpt.path)
    if req.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise LayoutError(lay.file, "--tensorboard", "needs the tensorboard package (pip install tensorboard)")
    if not req.dry_run and rank is not None:  # last (the ranks a launcher starts: node.run_ranks, after the data)
        rendezvous.check_port_free(plan, [rank])  # the server rank's port taken here: one line, before it starts
    options = RunOptions(
        tuple(req.overrides),
        req.metrics_jsonl,
        req.checkpoint,
        req.checkpoint_every,
        resume,
        req.trace,
        req.quiet,
        req.tensorboard,
        keep_last=keep,
    )
    return Prepared(lay, plan, rank, ranks, options)


def check_data(p: Prepared):
    """The data and ``init_from``'s weights, read once before the ranks start (a rank started on its own, with
    no launcher, reads its data file here too); returns the data source (its loss floor is printed)."""
    if p.rank is not None:
        if p.layout.data.path:  # on its own: no launcher checked it
            return checked_source(p.layout)
        return None
    source = checked_source(p.layout)  # tokenizes a text file once, before any rank starts
    check_init_weights(p.layout, p.options.resume)
    return source


def _ranks_here(plan: Plan) -> list[int]:
    """The ranks of the nodes whose host is this machine (none: a dry run elsewhere)."""
    try:
        return launcher.local_ranks(plan, None)
    except LayoutError:
        return []


def load_layout(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Layout:
    """The layout at ``path`` (with ``--set`` overrides), with every check that reads no data: the TOML's keys and
    values (layout.load) and the files it names that must match it (``init_from``'s config.json)."""
    lay = layout_mod.load(path, overrides)
    check_init_from(lay)
    return lay


def check_init_from(lay: Layout) -> None:
    """``model.init_from``'s config.json against [model]: a located ``LayoutError`` for the first difference
    (torch-free: reads config.json only; the weights are read by each rank, its slices only)."""
    if lay.model.init_from:
        from hetero_llm.interop import hf_config

        hf_config.check_config(lay)


def check_init_weights(lay: Layout, resume: str | None) -> None:
    """``model.init_from``'s weights read once, before any rank starts: a tensor holding NaN or infinite values
    is named here (a resumed run takes its parameters from the checkpoint instead)."""
    if lay.model.init_from and not resume:
        from hetero_llm.interop import hf

        hf.check_weights(lay)


def checked_source(lay: Layout):
    """The layout's data source, refused now if it cannot give one window of text or holds ids outside
    model.vocab (rather than in every rank)."""
    from hetero_llm.data import sources, text_cache, token_files

    spec = sources.SourceSpec.of(lay.data)
    source = sources.make_source(spec, lay.file)
    if spec.documents:  # whole documents, however short: found now, or why not
        sources.document_sources(spec, lay.model.seq_len, lay.file)  # and the held-out ones
    elif isinstance(source, text_cache.TokenFileSource):
        source.require_text(lay.model.seq_len + 1)
    token_files.check_vocab(source, lay.model.vocab, lay.file)
    return source
