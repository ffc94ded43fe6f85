"""Checkpoint folders on disk: where a save goes, which saves are complete, whether one fits a model.

    DIR/                     the --checkpoint DIR of a run
      latest                 "step-000040": the newest complete save, replaced atomically after its meta.json
      step-000020/           one folder per save, named by the optimizer steps taken before it
      step-000040/
        rank0.pt ...         one file per rank of the layout that saved (shards.py writes them): its parameter
                             shards and their AdamW moments, keyed by global names with their shard coordinates
        meta.json            written last, once every rank's file is on disk: a folder without it is an
                             interrupted save and is never resumed from. It records each rank file's size,
                             sha256 and shards (name -> shard dim, [lo, hi), shape), so ``verify`` finds a
                             damaged, truncated or swapped file before any rank reads one

Because shards are keyed by global names and coordinates, any layout of the same model can resume any
save. Torch-free, so the CLI checks ``--resume`` (the folder, a complete save, the model) before any rank starts.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from hetero_llm._fs import TMP, device_of, free_bytes, fsync_dir, loads_json, no_space, not_regular, write_atomically
from hetero_llm.errors import CheckpointError, LayoutError
from hetero_llm.layout import Layout, spec_dict
from hetero_llm.model.params import all_params
from hetero_llm.progress import Bar

if TYPE_CHECKING:
    from hetero_llm.plan.rank import RankPlan, Shard

DEFAULT_KEEP = 3  # complete saves kept with --checkpoint-every and no --keep-last (without it: every save)
SNAPSHOTS_KEPT = 2  # snapshots each rank keeps without --keep-last (a peer may be one snapshot behind)
STEP_PREFIX = "step-"
META = "meta.json"
LATEST = "latest"
FIX = "pass the --checkpoint DIR of an earlier run or one of its step-NNNNNN folders, or start without --resume"


Coords = tuple[int | None, int, int, tuple[int, ...]]  # (shard dim or None: replicated, lo, hi, full shape)


@attrs.frozen
class RankFile:
    """What meta.json records of one rank file when it is saved, to check it before any rank reads it."""

    size: int  # bytes
    sha256: str  # hex digest of the file's bytes
    shards: dict[str, Coords]  # global parameter name -> where its shard sits in the full tensor


@attrs.frozen
class Checkpoint:
    """One complete save, as its meta.json describes it."""

    path: Path  # the step folder
    step: int  # optimizer steps taken before the save: a resumed run trains step index ``step`` next
    world_size: int  # ranks of the layout that saved it: rank0.pt .. rank{world_size - 1}.pt
    shapes: dict[str, tuple[int, ...]]  # global parameter name -> full shape
    layout: str  # the layout file that saved it (for people: any layout of the same model may resume it)
    files: dict[str, RankFile] | None = None  # rank file name -> its record; None: a save from before records

    def rank_file(self, rank: int) -> Path:
        return rank_file(self.path, rank)


def step_folder(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step:06d}"


def rank_file(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.pt"


# ------------------------------------------------------------------------------------------
# Writing: every file through a temporary name, fsync and rename, so a crash leaves the old file or the new one.


def begin_save(folder: Path) -> None:
    """Make ``folder`` and mark it incomplete (rank 0, before any rank writes its file).

    Saving again into a step folder (a resumed run passing a step it saved before) must not leave the
    old meta.json vouching for a mix of old and new rank files should this save be interrupted.
    """
    if folder.is_symlink():  # the CLI refused one before the run: one made since is not written through either
        raise CheckpointError(
            str(folder),
            "--checkpoint",
            f"is a symbolic link to '{os.readlink(folder)}' in the "
            "folder --checkpoint writes into (writes never follow one: remove the link, or give "
            "another folder)",
        )
    folder.mkdir(parents=True, exist_ok=True)
    remove_leftovers(folder.parent)
    if (folder / META).exists():
        (folder / META).unlink()
        fsync_dir(folder)


def remove_leftovers(root: Path) -> None:
    """Delete the temporary files a killed save left in checkpoint root ``root`` (``*.tmp`` in it and in its
    step folders). Rank 0 calls it before any rank of this save writes, so no file being written is touched."""
    for tmp in [*root.glob(f"*{TMP}"), *root.glob(f"{STEP_PREFIX}*/*{TMP}")]:
        tmp.unlink(missing_ok=True)


def no_space_error(root: str | os.PathLike, path: Path, needed: int) -> CheckpointError:
    """The one line for a save that found its disk full writing ``path`` (``needed`` bytes; its temporary file
    already removed, so the free space is what the disk has without it)."""
    return CheckpointError(
        str(root),
        "--checkpoint",
        f"no space left on {device_of(path)} writing {path} ({needed / 1e6:.1f} MB needed, "
        f"{free_bytes(path) / 1e6:.1f} MB free: free space or give --checkpoint another disk)",
    )


def file_digest(path: Path, progress: Callable[[int], None] | None = None) -> tuple[int, str]:
    """(size in bytes, sha256 hex digest) of the file at ``path``; ``progress(bytes)`` after each chunk read."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
            if progress is not None:
                progress(len(chunk))
    return size, digest.hexdigest()


def file_records(shards_by_rank: Sequence[Sequence[Shard]], digests: list[tuple[int, str]]) -> dict[str, RankFile]:
    """Each rank file's record: ``digests[rank]`` (its size and sha256) and the shards the plan gives that rank
    (``RankPlan.saved_shards``)."""
    return {
        rank_file(Path(), r).name: RankFile(size, sha, {s.name: s.coords for s in shards_by_rank[r]})
        for r, (size, sha) in enumerate(digests)
    }


def finish_save(
    folder: Path, step: int, world_size: int, layout: Layout | RankPlan, files: dict[str, RankFile] | None = None
) -> None:
    """Mark ``folder`` complete, then point ``latest`` at it (rank 0, once every rank's file is on disk).
    ``layout``: its file, model and data go into meta.json (a ``RankPlan`` carries them too)."""
    meta = {
        "step": step,
        "world_size": world_size,
        "layout": layout.file,
        "params": {p.name: list(p.shape) for p in all_params(layout.model)},
        "model": spec_dict(layout.model),
        "data": spec_dict(layout.data),
    }  # for hetero-export / hetero-generate
    if files is not None:
        meta["files"] = {
            name: {
                "bytes": f.size,
                "sha256": f.sha256,
                "shards": {
                    n: {"dim": dim, "range": [lo, hi], "shape": shard_shape(dim, lo, hi, full)}
                    for n, (dim, lo, hi, full) in f.shards.items()
                },
            }
            for name, f in files.items()
        }
    _write_small(folder.parent, folder / META, _json_lines(meta) + "\n")
    _write_small(folder.parent, folder.parent / LATEST, f"{folder.name}\n")


def _write_small(root: Path, path: Path, text: str) -> None:
    """meta.json or ``latest`` of checkpoint root ``root``, atomically; a full disk is one line."""
    data = text.encode()
    try:
        write_atomically(path, lambda f: f.write(data))
    except OSError as e:
        if no_space(e):
            raise no_space_error(root, path, len(data)) from None
        raise


def _json_lines(value, indent: str = "") -> str:
    """JSON with one line per entry of a dict that holds dicts or more than 4 entries (a parameter, a shard)."""
    if not isinstance(value, dict) or not (len(value) > 4 or any(isinstance(v, dict) for v in value.values())):
        return json.dumps(value)
    inner = indent + " "
    entries = ",\n".join(f"{inner}{json.dumps(k)}: {_json_lines(v, inner)}" for k, v in value.items())
    return f"{{\n{entries}\n{indent}}}"


def keep_count(file: str, given: int | None, every: int, checkpoint: str | None) -> int:
    """How many complete saves a run keeps: ``--keep-last N`` (``given``), else ``DEFAULT_KEEP`` with
    ``--checkpoint-every`` (a save per step must not fill the disk), else 0 (every save: they are few). A bad N
    is one ``LayoutError``."""
    if given is None:
        return DEFAULT_KEEP if every else 0
    if given < 1:
        raise LayoutError(
            file,
            "--keep-last",
            f"'{given}' is not a number of saves >= 1 (the newest N complete saves are kept; without it "
            f"{DEFAULT_KEEP} with --checkpoint-every, else every save)",
        )
    if not checkpoint:
        raise LayoutError(file, "--keep-last", "needs --checkpoint DIR (the folder whose saves it keeps)")
    return given


def prune(root: str | os.PathLike, keep: int, protect: Sequence[str | os.PathLike] = ()) -> list[Path]:
    """Remove all but the newest ``keep`` complete saves of checkpoint root ``root`` (``keep`` 0: none), never one
    in ``protect`` (the save being resumed from) nor the one ``latest`` names; the removed folders. Each removal
    drops ``meta.json`` first (and syncs the folder): a save half removed is an incomplete one, never resumed."""
    root = Path(root)
    if keep < 1 or not root.is_dir():
        return []
    complete = sorted(
        (step, d) for d in root.glob(f"{STEP_PREFIX}*") if (step := _step_of(d)) is not None and (d / META).exists()
    )
    latest = root / LATEST
    named = latest.read_text(errors="replace").strip() if latest.exists() and not not_regular(latest) else ""
    protected = {Path(p).resolve() for p in protect}
    removed = []
    for _, folder in complete[:-keep]:
        if folder.name == named or folder.resolve() in protected or folder.is_symlink():
            continue
        (folder / META).unlink(missing_ok=True)
        fsync_dir(folder)
        for entry in folder.iterdir():
            if entry.is_file() or entry.is_symlink():
                entry.unlink(missing_ok=True)
        try:
            folder.rmdir()
        except OSError:  # something else in it: incomplete now, never resumed; left for its owner
            pass
        removed.append(folder)
    return removed


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
        raise CheckpointError(
            str(path),
            "--resume",
            f"an incomplete save (no {META}: it was interrupted); pass its "
            f"parent folder to resume from the newest complete save",
        )
    folder = _newest_complete(p)
    if folder is None:
        raise CheckpointError(
            str(path),
            "--resume",
            f"no complete checkpoint here (no step-NNNNNN folder with a "
            f"{META}; a save interrupted before writing it does not count): {FIX}",
        )
    return _read(folder)


def _newest_complete(root: Path) -> Path | None:
    # ``latest`` is the run's own word; it can only name an incomplete folder when a later save into that
    # same folder was interrupted, and then the highest-numbered complete folder is the newest save.
    latest = root / LATEST
    if latest.exists():
        _check_regular(latest, f" (delete it to resume from the highest-numbered complete save of {root})")
        text = latest.read_text(errors="replace").strip()
        named = root / text
        # A bare step-NNNNNN name, and a folder in ``root``: ``latest`` never leads outside the checkpoint.
        if _step_of(Path(text)) is None or Path(text).name != text or named.resolve().parent != root.resolve():
            raise CheckpointError(
                str(latest),
                "--resume",
                f"names {text!r}, not a step-NNNNNN folder of {root} "
                f"(write the name of one of its step folders into it, or delete it to resume from "
                f"the highest-numbered complete one)",
            )
        if (named / META).exists():
            return named
    complete = {
        d: step for d in root.glob(f"{STEP_PREFIX}*") if (step := _step_of(d)) is not None and (d / META).exists()
    }
    return max(complete, key=complete.__getitem__, default=None)


def _step_of(folder: Path) -> int | None:
    """The step a step folder's name says (``step-000040``: 40); None for any other name."""
    digits = folder.name[len(STEP_PREFIX) :]
    return int(digits) if folder.name.startswith(STEP_PREFIX) and digits.isdigit() else None


def _check_regular(path: Path, then: str) -> None:
    """Refuse a file of a save that is not a regular file before opening it (a FIFO would block the reader);
    ``then``: what the message says after it."""
    what = not_regular(path)
    if what:
        raise CheckpointError(str(path), "--resume", f"is {what}, not a regular file{then}")


def _read(folder: Path) -> Checkpoint:
    _check_regular(folder / META, f" ({FIX})")
    try:
        meta = loads_json((folder / META).read_bytes())
        shapes = {name: tuple(int(n) for n in shape) for name, shape in meta["params"].items()}
        files = None
        if "files" in meta:
            files = {
                name: RankFile(
                    int(f["bytes"]),
                    str(f["sha256"]),
                    {
                        n: (
                            None if c["dim"] is None else int(c["dim"]),
                            int(c["range"][0]),
                            int(c["range"][1]),
                            shapes[n],
                        )
                        for n, c in f["shards"].items()
                    },
                )
                for name, f in meta["files"].items()
            }
        ckpt = Checkpoint(folder, int(meta["step"]), int(meta["world_size"]), shapes, str(meta["layout"]), files)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise CheckpointError(
            str(folder), "--resume", f"{META} is not a hetero_llm checkpoint's ({type(e).__name__}: {e}); {FIX}"
        ) from None
    if ckpt.world_size < 1 or ckpt.step < 0:
        raise CheckpointError(
            str(folder),
            "--resume",
            f"{META} is not a hetero_llm checkpoint's (step {ckpt.step}, world_size {ckpt.world_size}); {FIX}",
        )
    # The folder's rank files bound the ranks looked for: a world_size of 10^12 finds its first gap among them.
    on_disk = {entry.name for entry in os.scandir(folder)}
    for r in range(min(ckpt.world_size, len(on_disk) + 1)):
        path = ckpt.rank_file(r)
        if path.name not in on_disk or not path.exists():  # (a link to nothing is missing too)
            raise CheckpointError(
                str(folder),
                "--resume",
                f"{path.name} is missing (the layout that saved it had {ckpt.world_size} ranks); {FIX}",
            )
        _check_regular(path, f": the save is damaged; {DAMAGED}")
    return ckpt


DAMAGED = "resume from another step folder (or start without --resume)"
UNVERIFIED = (
    f"{META} records no sizes or checksums of its rank files (a save by an earlier hetero_llm): "
    "resuming without verifying them"
)


def verify(ckpt: Checkpoint, progress: bool = True) -> str | None:
    """Check every rank file against what meta.json recorded when it was saved: its size, its sha256, and that
    its shards are slices of the model's tensors that together cover each of them. Raises CheckpointError
    naming the first bad file; returns a warning for a save from before the records (resumed unchecked).

    Reads every byte of the save (sha256 runs at about 1-2 GB/s): the CLI calls it once, before any rank starts,
    showing its progress on a terminal (``progress``; ``progress.Bar``).
    """
    if ckpt.files is None:
        return f"{ckpt.path}: --resume: {UNVERIFIED}"
    names = [rank_file(ckpt.path, r).name for r in range(ckpt.world_size)]
    unknown = sorted(set(ckpt.files) ^ set(names))
    if unknown:
        raise CheckpointError(
            str(ckpt.path),
            "--resume",
            f"{META} records the rank files {sorted(ckpt.files)} "
            f"but its world_size is {ckpt.world_size}: the save is damaged; {DAMAGED}",
        )
    total = sum(f.size for f in ckpt.files.values())
    bar = Bar(f"verifying {ckpt.path}", total, "B", enabled=None if progress else False)
    try:
        for name in names:
            path, record = ckpt.path / name, ckpt.files[name]
            size = path.stat().st_size
            if size != record.size:
                raise CheckpointError(
                    str(path),
                    "--resume",
                    f"{size} bytes, but {record.size} were saved (truncated or replaced since); {DAMAGED}",
                )
            if file_digest(path, bar.update)[1] != record.sha256:
                raise CheckpointError(
                    str(path),
                    "--resume",
                    f"its sha256 is not the one {META} recorded when it was "
                    f"saved (the file changed since: damaged, edited, or copied from another save); "
                    f"{DAMAGED}",
                )
            for param, coords in record.shards.items():
                problem = shard_problem(param, coords, ckpt.shapes)
                if problem:
                    raise CheckpointError(str(path), "--resume", f"{problem}: the save is damaged; {DAMAGED}")
    finally:
        bar.close()  # before any error line
    for param, full in ckpt.shapes.items():
        gap = uncovered(param, full, [f.shards[param] for f in ckpt.files.values() if param in f.shards])
        if gap:
            raise CheckpointError(
                str(ckpt.path), "--resume", f"{gap} is in no rank file: the save is incomplete; {DAMAGED}"
            )
    return None


def shard_shape(dim: int | None, lo: int, hi: int, full: tuple[int, ...]) -> list[int]:
    return [hi - lo if d == dim else n for d, n in enumerate(full)]


def shard_problem(name: str, coords: Coords, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """Why a recorded shard is not a slice of the model's tensor ``name`` (None: it is)."""
    dim, lo, hi, full = coords
    if name not in shapes:
        return f"holds {name}, which is not a tensor of the model {META} describes"
    along = full[0 if dim is None else dim] if (dim is None or 0 <= dim < len(full)) else None
    if along is None or not 0 <= lo < hi <= along or (dim is None and (lo, hi) != (0, along)):
        return f"its shard of {name} ({list(full)}) is rows [{lo}, {hi}) of dim {dim}, outside the tensor"
    return None


def uncovered(name: str, full: tuple[int, ...], shards: list[Coords]) -> str | None:
    """The first part of tensor ``name`` that no shard holds, in words (None: every element is held)."""
    if any(dim is None for dim, *_rest in shards):
        return None
    if not shards:
        return name
    dim = shards[0][0]
    assert dim is not None  # a replicated shard (dim None) returned above
    end = 0
    for _, lo, hi, _ in sorted(s for s in shards if s[0] == dim):
        if lo > end:
            break
        end = max(end, hi)
    return None if end >= full[dim] else f"{name} from row {end} of dim {dim}"


def for_resume(path: str | os.PathLike, layout: Layout | RankPlan) -> Checkpoint:
    """The complete save ``path`` names, checked to be one ``layout`` (or a rank's plan of it) can resume."""
    ckpt = find(path)
    check_fits(ckpt, layout)
    return ckpt


def check_fits(ckpt: Checkpoint, layout: Layout | RankPlan) -> None:
    """``layout`` can resume ``ckpt``: the same global parameter names and full shapes, and steps left to train."""
    want = {p.name: p.shape for p in all_params(layout.model)}
    missing = [n for n in want if n not in ckpt.shapes]
    extra = [n for n in ckpt.shapes if n not in want]
    reshaped = [
        f"{n} is {list(want[n])} in the layout's model but {list(ckpt.shapes[n])} in the checkpoint"
        for n in want
        if n in ckpt.shapes and ckpt.shapes[n] != want[n]
    ]
    differences = (
        ([f"the checkpoint lacks {_some(missing)}"] if missing else [])
        + ([f"the layout's model lacks {_some(extra)}"] if extra else [])
        + reshaped[:1]
    )
    if differences:
        raise CheckpointError(
            str(ckpt.path),
            "--resume",
            f"a checkpoint of a different model than {layout.file}'s: "
            f"{'; '.join(differences)} (resume with the [model] it was trained with, or start "
            f"without --resume)",
        )
    steps = layout.train.steps
    if ckpt.step >= steps:
        raise CheckpointError(
            str(ckpt.path),
            "--resume",
            f"the checkpoint is at step {ckpt.step} and train.steps is "
            f"{steps}: nothing left to train (raise it, e.g. --set train.steps={ckpt.step + steps})",
        )


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:2])
    return shown if len(names) <= 2 else f"{shown} and {len(names) - 2} more"
