"""What a rank is asked besides its plan: the run's options (``hetero-launch``'s flags), and where a rank started by a
launcher reports its failure for the launcher to print. Torch-free: the launcher builds and reads these before any
rank imports torch."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path

import attrs

from hetero_llm.errors import HeteroError


@attrs.frozen
class RunOptions:
    """Per-run options that are not part of the layout (CLI flags), and how the rank was started."""

    overrides: tuple[str, ...] = ()
    metrics_jsonl: str | None = None
    checkpoint: str | None = None
    checkpoint_every: int = 0  # save every N steps as well as at the end; 0: at the end only
    resume: str | None = None  # the step folder to resume from (the CLI resolves a checkpoint root to one)
    trace: str | None = None
    quiet: bool = False
    tensorboard: str | None = None  # write loss, valid_loss, lr, grad_norm as TensorBoard scalars here
    snapshot: tuple[str | None, int] = (None, 0)  # elastic runs: also save here every K steps (node memory)
    # The folder a launcher (node.run_ranks) reads its ranks' failures from, made by the first rank that reports;
    # None: the rank runs on its own (--rank R, torchrun, srun, an elastic worker) and prints its own failure.
    error_dir: str | None = None
    keep_last: int = 0  # --keep-last: the newest N complete saves kept (older ones removed); 0: every save kept
    keep_snapshots: int = 2  # snapshots each rank keeps in node memory (--keep-last N with --elastic)
    # An elastic worker's: called with the heartbeat's line when a peer stops responding, instead of the process
    # ending (it opens the round's next generation: the survivors recover in place, launch/in_place.py); None: exit.
    on_lost_peer: Callable[[str], None] | None = attrs.field(default=None, eq=False)


def failure_file(error_dir: str | Path, rank: int) -> Path:
    """The one line a failed rank leaves for its launcher."""
    return Path(error_dir, f"rank{rank}.err")


def traceback_file(error_dir: str | Path, rank: int) -> Path:
    """The traceback beside it."""
    return Path(error_dir, f"rank{rank}.traceback")


def report_failure(options: RunOptions, rank: int, e: BaseException) -> None:
    """Leave why ``rank`` failed (one line, and the traceback) where its launcher reads it; nothing on its own."""
    if not options.error_dir:
        return
    cause = f"{type(e).__name__}: {e}".splitlines()[0] if not isinstance(e, HeteroError) else str(e).splitlines()[0]
    os.makedirs(options.error_dir, mode=0o700, exist_ok=True)  # the launcher names it; the first report creates it
    failure_file(options.error_dir, rank).write_text(cause + "\n")
    traceback_file(options.error_dir, rank).write_text(traceback.format_exc())
