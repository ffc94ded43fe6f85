"""Checkpoint folders on disk: where a save goes, which saves are complete, whether one fits a model.

    DIR/                     the --checkpoint DIR of a run
      latest                 "step-000040": the newest complete save, replaced atomically after its meta.json
      step-000020/           one folder per save, named by the optimizer steps taken before it
      step-000040/
        rank0.pt ...         one file per rank of the layout that saved (train.py writes them): its parameter
                             shards and their AdamW moments, keyed by global names with their shard coordinates
        meta.json            written last, once every rank's file is on disk: a folder without it is an
                             interrupted save and is never resumed from

Because shards are keyed by global names and coordinates, any layout of the same model can resume any
save. Torch-free, so the CLI checks ``--resume`` (the folder, a complete save, the model) before any rank starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import attrs

from hetero_llm.errors import CheckpointError
from hetero_llm.layout import Layout
from hetero_llm.params import all_params

STEP_PREFIX = "step-"
META = "meta.json"
LATEST = "latest"
FIX = "pass the --checkpoint DIR of an earlier run or one of its step-NNNNNN folders, or start without --resume"


@attrs.frozen
class Checkpoint:
    """One complete save, as its meta.json describes it."""

    path: Path  # the step folder
    step: int  # optimizer steps taken before the save: a resumed run trains step index ``step`` next
    world_size: int  # ranks of the layout that saved it: rank0.pt .. rank{world_size - 1}.pt
    shapes: dict[str, tuple[int, ...]]  # global parameter name -> full shape
    layout: str  # the layout file that saved it (for people: any layout of the same model may resume it)

    def rank_file(self, rank: int) -> Path:
        return rank_file(self.path, rank)


def step_folder(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step:06d}"


def rank_file(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.pt"


# ------------------------------------------------------------------------------------------
# Writing: every file through a temporary name, fsync and rename, so a crash leaves the old file or the new one.


def write_atomically(path: Path, write: Callable[[object], None]) -> None:
    """Write ``path`` by ``write(binary file)`` into ``path.tmp``, fsync it, rename it over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)  # the rename itself survives a power loss


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin_save(folder: Path) -> None:
    """Make ``folder`` and mark it incomplete (rank 0, before any rank writes its file).

    Saving again into a step folder (a resumed run passing a step it saved before) must not leave the
    old meta.json vouching for a mix of old and new rank files should this save be interrupted.
    """
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / META).exists():
        (folder / META).unlink()
        _fsync_dir(folder)


def finish_save(folder: Path, step: int, world_size: int, layout: Layout) -> None:
    """Mark ``folder`` complete, then point ``latest`` at it (rank 0, once every rank's file is on disk)."""
    meta = {"step": step, "world_size": world_size, "layout": layout.file,
            "params": {p.name: list(p.shape) for p in all_params(layout.model)}}
    write_atomically(folder / META, lambda f: f.write(json.dumps(meta, indent=1).encode()))
    write_atomically(folder.parent / LATEST, lambda f: f.write(f"{folder.name}\n".encode()))


# ------------------------------------------------------------------------------------------
# Reading: a step folder, or a checkpoint root's newest complete save.


def find(path: str | os.PathLike) -> Checkpoint:
    """The complete save ``path`` names: a step folder, or DIR's newest (``latest`` when it is complete)."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(str(path), "--resume", f"no such folder ({FIX})")
    if (p / META).exists():
        return _read(p)
    if _step_of(p) is not None:
        raise CheckpointError(str(path), "--resume", f"an incomplete save (no {META}: it was interrupted); pass its "
                              f"parent folder to resume from the newest complete save")
    folder = _newest_complete(p)
    if folder is None:
        raise CheckpointError(str(path), "--resume", f"no complete checkpoint here (no step-NNNNNN folder with a "
                              f"{META}; a save interrupted before writing it does not count): {FIX}")
    return _read(folder)


def _newest_complete(root: Path) -> Path | None:
    # ``latest`` is the run's own word; it can only name an incomplete folder when a later save into that
    # same folder was interrupted, and then the highest-numbered complete folder is the newest save.
    latest = root / LATEST
    if latest.exists():
        named = root / latest.read_text().strip()
        if _step_of(named) is not None and (named / META).exists():
            return named
    complete = [d for d in root.glob(f"{STEP_PREFIX}*") if _step_of(d) is not None and (d / META).exists()]
    return max(complete, key=_step_of, default=None)


def _step_of(folder: Path) -> int | None:
    """The step a step folder's name says (``step-000040``: 40); None for any other name."""
    digits = folder.name[len(STEP_PREFIX):]
    return int(digits) if folder.name.startswith(STEP_PREFIX) and digits.isdigit() else None


def _read(folder: Path) -> Checkpoint:
    try:
        meta = json.loads((folder / META).read_text())
        ckpt = Checkpoint(folder, int(meta["step"]), int(meta["world_size"]),
                          {name: tuple(shape) for name, shape in meta["params"].items()}, str(meta["layout"]))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(str(folder), "--resume", f"{META} is not a hetero_llm checkpoint's ({type(e).__name__}: "
                              f"{e}); {FIX}") from None
    missing = [r for r in range(ckpt.world_size) if not ckpt.rank_file(r).exists()]
    if missing:
        raise CheckpointError(str(folder), "--resume", f"{rank_file(folder, missing[0]).name} is missing (the layout "
                              f"that saved it had {ckpt.world_size} ranks); {FIX}")
    return ckpt


def for_resume(path: str | os.PathLike, layout: Layout) -> Checkpoint:
    """The complete save ``path`` names, checked to be one ``layout`` can resume."""
    ckpt = find(path)
    check_fits(ckpt, layout)
    return ckpt


def check_fits(ckpt: Checkpoint, layout: Layout) -> None:
    """``layout`` can resume ``ckpt``: the same global parameter names and full shapes, and steps left to train."""
    want = {p.name: p.shape for p in all_params(layout.model)}
    missing = [n for n in want if n not in ckpt.shapes]
    extra = [n for n in ckpt.shapes if n not in want]
    reshaped = [f"{n} is {list(want[n])} in the layout's model but {list(ckpt.shapes[n])} in the checkpoint"
                for n in want if n in ckpt.shapes and ckpt.shapes[n] != want[n]]
    differences = ([f"the checkpoint lacks {_some(missing)}"] if missing else []) + \
                  ([f"the layout's model lacks {_some(extra)}"] if extra else []) + reshaped[:1]
    if differences:
        raise CheckpointError(str(ckpt.path), "--resume", f"a checkpoint of a different model than {layout.file}'s: "
                              f"{'; '.join(differences)} (resume with the [model] it was trained with, or start "
                              f"without --resume)")
    steps = layout.train.steps
    if ckpt.step >= steps:
        raise CheckpointError(str(ckpt.path), "--resume", f"the checkpoint is at step {ckpt.step} and train.steps is "
                              f"{steps}: nothing left to train (raise it, e.g. --set train.steps={ckpt.step + steps})")


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:2])
    return shown if len(names) <= 2 else f"{shown} and {len(names) - 2} more"
