"""In-memory snapshots of an elastic run (``--snapshot-every K``): written in the background, resumed by holders.

A snapshot is taken at a step boundary as a CPU copy of the rank's parameters and AdamW moments (synchronous and
cheap), then written by a background thread while the next steps compute; at most one write is in flight per rank
(the next snapshot waits for it). Nothing in the write is collective: each rank writes, into its round's folder,

    ROUND/step-NNNNNN/rank{R}.pt     its shards (the checkpoint format of ``shards.save_checkpoint``)
    ROUND/step-NNNNNN/rank{R}.json   written after the .pt (both atomically): what it holds, its size and sha256

so a ``.json`` vouches for a whole ``.pt``. Each rank keeps its two newest snapshots (a peer may be one snapshot
behind when a node is lost). At a restart, ``seal_newest`` finds the newest step whose rank files, among those
visible, hold every parameter block and optimizer slice (a DP replica's copy is as good as the lost rank's),
hard-links them into ``SEALED/step-NNNNNN`` with a ``meta.json`` (a complete save, resumed as any other), and
removes the rest. ``ROUND`` is one per round (``<plan fingerprint>-<start step>``): files of different layouts
are never mixed.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import attrs
import torch

from hetero_llm._fs import write_atomically
from hetero_llm.checkpoint import folders
from hetero_llm.checkpoint.shards import MOMENTS, optimizer_steps
from hetero_llm.errors import RankFailure
from hetero_llm.layout import Layout
from hetero_llm.model.params import all_params
from hetero_llm.plan.rank import RankPlan
from hetero_llm.runtime import zero1

SEALED = "sealed"  # the complete save a round resumes from, made of hard links to the holders' files
KEEP = 2  # snapshots each rank keeps


@attrs.define
class SnapshotWriter:
    """One rank's snapshots into ``root`` (its round's folder), written by a background thread."""

    rp: RankPlan
    root: Path
    thread: threading.Thread | None = None
    failure: str | None = None  # why the last write failed (raised at the next step boundary)
    written: list[int] = attrs.field(factory=list)  # steps of this rank's complete snapshots, oldest first

    def take(self, state, optimizer, step: int) -> None:
        """Copy the rank's state at step ``step`` (now) and write it in the background (once the previous write
        is done)."""
        self.wait()
        if isinstance(optimizer, zero1.ShardedAdamW):
            optimizer.wait_gather()
            moments = optimizer.full_moments()  # collective: on the training thread, at the step boundary
        else:
            moments = {name: optimizer.state[p] for name, p in state.params.items()}
        shards = {
            name: {
                "tensor": _copy(p),
                "coords": state.coords[name],
                **{key: _copy(moments[name][key]) for key in MOMENTS},
            }
            for name, p in state.params.items()
        }
        saved = {"rank": self.rp.rank, "step": step, "optimizer_steps": optimizer_steps(optimizer), "shards": shards}
        self.thread = threading.Thread(target=self._write, args=(saved, step), name="snapshot", daemon=True)
        self.thread.start()

    def check(self) -> None:
        """Raise (naming the rank) if the last write failed."""
        if self.failure is not None:
            raise RankFailure(self.failure)

    def wait(self) -> None:
        """Until the write in flight is done; raise if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.check()

    def _write(self, saved: dict, step: int) -> None:
        folder = folders.step_folder(self.root, step)
        path = folders.rank_file(folder, self.rp.rank)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_atomically(path, lambda f: torch.save(saved, f))
            size, sha = folders.file_digest(path)
            record = {
                "step": step,
                "world_size": self.rp.world_size,
                "bytes": size,
                "sha256": sha,
                "shards": {name: shard["coords"] for name, shard in saved["shards"].items()},
            }
            text = json.dumps(record).encode()
            write_atomically(path.with_suffix(".json"), lambda f: f.write(text))
            self.written.append(step)
            while len(self.written) > KEEP:
                old = folders.rank_file(folders.step_folder(self.root, self.written.pop(0)), self.rp.rank)
                old.with_suffix(".json").unlink(missing_ok=True)  # the record first: no record vouches for nothing
                old.unlink(missing_ok=True)
                _rmdir(old.parent)
        except BaseException as e:
            self.failure = (
                f"rank {self.rp.rank} ({self.rp.info.device_id}) could not write its snapshot of step {step} into "
                f"{folder}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (free memory in "
                f"{self.root.parent.parent} or set HETERO_SHM_DIR to another folder)"
            )


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy that later steps do not change (``.cpu()`` of a CPU tensor is the tensor itself)."""
    return t.detach().to("cpu", copy=True)


def _rmdir(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # not empty (another rank's files) or gone
        pass


@attrs.frozen
class Candidate:
    """A step of a round folder whose rank files hold every parameter block and optimizer slice."""

    step: int
    files: list[tuple[Path, dict]]  # the holders' rank files and their records (a subset that covers the model)


def covered_steps(base: Path, shapes: dict[str, tuple[int, ...]]) -> list[Candidate]:
    """Every (round, step) under ``base`` whose recorded rank files cover every tensor of ``shapes`` (the model's
    parameters; the moments are saved with the same coordinates), newest first."""
    found = []
    for folder in sorted(base.glob(f"*/{folders.STEP_PREFIX}*")):
        if folder.parent.name == SEALED:
            continue
        records = []
        for path in sorted(folder.glob("rank*.json")):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            pt = path.with_suffix(".pt")
            if pt.exists() and pt.stat().st_size == record.get("bytes"):
                records.append((pt, record))
        if records and all(_holders(records, name, full) for name, full in shapes.items()):
            found.append(Candidate(records[0][1]["step"], records))
    return sorted(found, key=lambda c: c.step, reverse=True)


def _holders(records: list[tuple[Path, dict]], name: str, full: tuple[int, ...]) -> bool:
    shards = [tuple(r["shards"][name][:3]) + (tuple(r["shards"][name][3]),) for _, r in records if name in r["shards"]]
    return folders.uncovered(name, full, shards) is None  # type: ignore[arg-type]


def seal_newest(base: Path, lay: Layout, newer_than: int) -> str | None:
    """The newest snapshot step after ``newer_than`` (the disk's newest save) that has a holder for every block,
    made a complete save under ``base/sealed`` (hard links: no copy), its step folder returned; or None. Either way
    only what that save needs is kept under ``base`` (one worker calls it, before any rank of the round reads)."""
    shapes = {p.name: tuple(p.shape) for p in all_params(lay.model)}
    sealed_root = base / SEALED
    previous = _complete_step(sealed_root)
    best = next(iter(covered_steps(base, shapes)), None) if base.is_dir() else None
    chosen: str | None = None
    if best is not None and best.step > max(newer_than, previous if previous is not None else -1):
        folder = folders.step_folder(sealed_root, best.step)
        shutil.rmtree(sealed_root, ignore_errors=True)
        folder.mkdir(parents=True)
        files = {}
        for new_rank, (pt, record) in enumerate(best.files):
            _link(pt, folders.rank_file(folder, new_rank))
            coords = {name: (c[0], c[1], c[2], tuple(c[3])) for name, c in record["shards"].items()}
            files[folders.rank_file(Path(), new_rank).name] = folders.RankFile(
                record["bytes"], record["sha256"], coords
            )
        folders.finish_save(folder, best.step, len(best.files), lay, files)
        chosen = str(folder)
    elif previous is not None and previous > newer_than:
        chosen = str(folders.step_folder(sealed_root, previous))
    for other in base.iterdir() if base.is_dir() else ():
        if not (chosen and other.name == SEALED):
            shutil.rmtree(other, ignore_errors=True)
    return chosen


def _link(source: Path, target: Path) -> None:
    """``target`` the same file as ``source`` (a hard link: no copy), or a copy where the folder cannot link."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _complete_step(root: Path) -> int | None:
    complete = [d for d in root.glob(f"{folders.STEP_PREFIX}*") if (d / folders.META).exists()]
    return max((int(d.name[len(folders.STEP_PREFIX) :]) for d in complete), default=None)
