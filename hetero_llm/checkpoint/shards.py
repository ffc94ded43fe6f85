"""Checkpoint shard I/O: each rank saves its shards and AdamW moments; a rank of any layout restores its slices.

A rank file holds that rank's shards keyed by global names with their coordinates, so a rank of any
layout of the same model finds its slices in them. The folders, ``meta.json`` and the completeness
checks (torch-free): ``hetero_llm.checkpoint.folders``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import attrs
import numpy as np
import torch

from hetero_llm._fs import no_space, write_atomically
from hetero_llm.checkpoint import folders
from hetero_llm.checkpoint.folders import Checkpoint
from hetero_llm.comm import collectives
from hetero_llm.errors import CheckpointError
from hetero_llm.plan.rank import RankPlan
from hetero_llm.progress import Bar
from hetero_llm.runtime import zero1
from hetero_llm.runtime.adamw import AdamW

if TYPE_CHECKING:
    from hetero_llm.runtime.state import RankState


MOMENTS = ("exp_avg", "exp_avg_sq")


def optimizer_steps(optimizer: torch.optim.Optimizer | AdamW | zero1.ShardedAdamW) -> int:
    """Steps taken: ours counts them once; torch's keeps a ``step`` tensor per parameter (all equal)."""
    if isinstance(optimizer, (AdamW, zero1.ShardedAdamW)):
        return optimizer.steps
    return int(next(iter(optimizer.state.values()))["step"])


def restore_optimizer(
    optimizer: torch.optim.Optimizer | AdamW | zero1.ShardedAdamW,
    params: dict[str, torch.Tensor],
    moments: dict[str, dict[str, torch.Tensor]],
    steps: int,
) -> None:
    """Give every parameter its saved ``exp_avg`` / ``exp_avg_sq`` and the optimizer its step count."""
    if isinstance(optimizer, zero1.ShardedAdamW):
        return optimizer.load_moments(moments, steps)  # its slices of them
    if isinstance(optimizer, AdamW):
        optimizer.steps = steps
    for name, p in params.items():
        entry = {key: moments[key][name].to(p.device) for key in ("exp_avg", "exp_avg_sq")}
        if not isinstance(optimizer, AdamW):
            # torch's creates a parameter's state at its first step only when absent; fused keeps the
            # step count as a float32 tensor on the parameter's device.
            entry["step"] = torch.tensor(float(steps), dtype=torch.float32, device=p.device)
        optimizer.state[p] = entry


def save_checkpoint(
    rp: RankPlan,
    state: RankState,
    optimizer: torch.optim.Optimizer | AdamW | zero1.ShardedAdamW,
    root: str,
    step: int,
    progress: bool = False,
    keep: int = 0,
    protect: Sequence[str | os.PathLike] = (),
) -> None:
    """Save the rank's shards and AdamW state into ``root``/step-NNNNNN (every rank calls it at the same step);
    rank 0 marks the save complete (meta.json) once every rank's file is on disk. ``progress``: show the writing
    and checksumming of this rank's file on a terminal (``progress.Bar``; the reporting rank's). ``keep``: then
    rank 0 keeps the newest ``keep`` complete saves, never one in ``protect`` (``folders.prune``; 0: all)."""
    rank = rp.rank
    folder = folders.step_folder(root, step)
    if rank == 0:
        folders.begin_save(folder)
    collectives.barrier()  # no rank overwrites a file of an earlier save into this folder while its meta.json stands
    folder.mkdir(parents=True, exist_ok=True)
    shards: dict[str, dict[str, Any]] = {}  # name -> "tensor" and the moments (tensors), "coords" (a tuple)
    if isinstance(optimizer, zero1.ShardedAdamW):
        optimizer.wait_gather()
        gathered = optimizer.full_moments()  # plain AdamW's format: any layout resumes it, sharded or not
    for name, p in state.params.items():
        moments = gathered[name] if isinstance(optimizer, zero1.ShardedAdamW) else optimizer.state[p]
        shards[name] = {
            "tensor": p.detach().cpu(),
            "coords": state.coords[name],
            **{key: moments[key].detach().cpu() for key in MOMENTS},
        }
    saved = {"rank": rank, "step": step, "optimizer_steps": optimizer_steps(optimizer), "shards": shards}
    path = folders.rank_file(folder, rank)
    payload = sum(t.nbytes for shard in shards.values() for key, t in shard.items() if key != "coords")
    bar = Bar(f"saving {folder}", 2 * payload, "B", enabled=None if progress else False)  # written, then read back
    failed: list[OSError] = []  # what a write raised: torch.save reports it as a RuntimeError of its own
    try:
        try:
            # torch.save writes through any object with write and flush; its stub asks for an IO[bytes]
            write_atomically(path, lambda f: torch.save(saved, _Counted(f, bar.update, failed)))  # type: ignore[arg-type]
        except Exception as e:
            if any(no_space(x) for x in (e, *failed)):  # the temporary file is gone, the earlier saves untouched
                raise folders.no_space_error(root, path, payload) from None
            raise
        digest = folders.file_digest(path, bar.update)
    finally:
        bar.close()
    # Also the barrier: every rank's file is on disk before meta.json marks the save complete.
    device = next(iter(state.params.values())).device
    digests = _all_digests(rp.world_size, rank, digest, device)
    if rank == 0:
        folders.finish_save(folder, step, rp.world_size, rp, folders.file_records(rp.saved_shards, digests))
        folders.prune(root, keep, [*protect, folder])  # never the save just written, even if older than others


@attrs.define
class _Counted:
    """A binary file that reports the bytes written through it (``torch.save`` writes only through ``write``)."""

    file: BinaryIO
    written: Callable[[int], None]
    failed: list[OSError] = attrs.field(factory=list)  # the OSError a write raised, kept for the caller

    def write(self, data) -> int:
        try:
            n = self.file.write(data)
        except OSError as e:
            self.failed.append(e)
            raise
        self.written(memoryview(data).nbytes if n is None else n)
        return n

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as e:
            self.failed.append(e)
            raise


def _all_digests(world_size: int, rank: int, digest: tuple[int, str], device: torch.device) -> list[tuple[int, str]]:
    """Every rank's (file size, sha256 hex), from each rank's own: one all-reduce of a (world, 5) int64 table
    in which each rank fills its row (the size, then the 32 digest bytes as 4 int64s) and leaves the rest 0."""
    size, sha = digest
    table = torch.zeros(world_size, 5, dtype=torch.int64)
    table[rank, 0] = size
    table[rank, 1:] = torch.from_numpy(np.frombuffer(bytes.fromhex(sha), dtype=np.int64).copy())
    rows = collectives.all_reduce_world(table.to(device)).cpu().numpy()
    return [(int(row[0]), row[1:].astype(np.int64).tobytes().hex()) for row in rows]


@attrs.frozen
class Restored:
    """What ``rank`` resumes from: its slices of the saved parameters and AdamW moments."""

    path: Path  # the step folder
    step: int
    optimizer_steps: int
    shards: dict[str, dict[str, torch.Tensor]]  # "tensor" (the parameter) | "exp_avg" | "exp_avg_sq" -> name -> slice


def restore(rp: RankPlan, path: str, progress: bool = False) -> Restored:
    """The rank's shards cut from the save ``path`` names (a step folder or a checkpoint root's newest), whatever
    layout saved it. ``progress``: show the rank files read on a terminal (the reporting rank's)."""
    ckpt = folders.for_resume(path, rp)
    ranges = {s.name: (s.lo, s.hi) for s in rp.shards}
    files = [_load_rank_file(ckpt, r) for r in range(ckpt.world_size)]
    steps = {f["optimizer_steps"] for f in files}
    if len(steps) != 1:
        raise CheckpointError(
            str(ckpt.path),
            "--resume",
            f"rank files disagree on the optimizer step "
            f"({sorted(steps)}): the save is damaged; resume from another step folder",
        )
    with _loading(ckpt, progress) as bar:
        shards = _assemble(_read_through(files, ckpt, bar), ranges, ("tensor", *MOMENTS), ckpt.path)
    _check_finite(shards, ckpt.path)
    return Restored(ckpt.path, ckpt.step, steps.pop(), shards)


def check_resumable(ckpt: Checkpoint) -> None:
    """Every check ``restore`` makes of a save's files, over the whole save (every rank file, every tensor), keeping
    nothing it read: each file readable as tensors only and its shards the model's shapes, every tensor covered, one
    optimizer step, finite values (the model and the steps left are ``folders.check_fits``', which the caller runs
    first: the runtime side never sees the layout). The elastic restart runs both on a snapshot step copied into
    ``--checkpoint DIR`` before sealing it (``launch.restart``), so no save is made that ``--resume`` would refuse.
    Raises ``CheckpointError`` naming the first problem."""
    steps: set[object] = set()  # each rank file's optimizer step, as it reads
    held: dict[str, list[folders.Coords]] = {}  # name -> the coordinates of every saved shard of it
    for rank in range(ckpt.world_size):
        saved = _load_rank_file(ckpt, rank)
        steps.add(saved.get("optimizer_steps"))
        for name, shard in saved["shards"].items():
            held.setdefault(name, []).append(tuple(shard["coords"]))
        _check_finite(
            {k: {n: shard[k] for n, shard in saved["shards"].items()} for k in ("tensor", *MOMENTS)}, ckpt.path
        )
    if len(steps) != 1 or not isinstance(next(iter(steps)), int):
        raise CheckpointError(
            str(ckpt.path),
            "--resume",
            f"rank files disagree on the optimizer step ({sorted(map(str, steps))}): the "
            f"save is damaged; {folders.DAMAGED}",
        )
    for name, full in ckpt.shapes.items():
        gap = folders.uncovered(name, full, held.get(name, []))
        if gap:
            raise CheckpointError(
                str(ckpt.path), "--resume", f"{gap} is in no rank file: the save is incomplete; {folders.DAMAGED}"
            )


def _check_finite(shards: dict[str, dict[str, torch.Tensor]], folder: Path) -> None:
    """Refuse a save holding NaN or infinite values: a save of a diverged run, or damage meta.json's checksums
    could not catch (a save without them, or a file written with its NaN and its checksum recorded)."""
    bad = next(
        (
            f"{key} of {name}"
            for key, by_name in shards.items()
            for name, t in by_name.items()
            if not torch.isfinite(t).all()
        ),
        None,
    )
    if bad:
        raise CheckpointError(str(folder), "--resume", f"the {bad} holds NaN or infinite values; {folders.DAMAGED}")


def _load_rank_file(ckpt: Checkpoint, rank: int) -> dict:
    """One rank file, memory-mapped (only the slices a rank copies out are read from disk), its shards checked
    against the model's shapes: ``folders.verify`` checked it before the ranks started, but a save from
    before meta.json's records was not."""
    path = ckpt.rank_file(rank)

    def damaged(problem: str) -> CheckpointError:
        return CheckpointError(str(path), "--resume", f"{problem}: the save is damaged; {folders.DAMAGED}")

    try:
        saved = torch.load(path, mmap=True, weights_only=True)
        shards = {
            name: (tuple(shard["coords"]), [shard[key].shape for key in ("tensor", *MOMENTS)])
            for name, shard in saved["shards"].items()
        }
    except Exception as e:
        raise damaged(f"cannot be read ({type(e).__name__}: {str(e).splitlines()[0].split('. ')[0]})") from None
    for name, ((dim, lo, hi, full), shapes) in shards.items():
        problem = folders.shard_problem(name, (dim, lo, hi, ckpt.shapes.get(name, ())), ckpt.shapes)
        if problem is None and tuple(full) != ckpt.shapes[name]:
            problem = f"its {name} is a shard of a {list(full)} tensor, but the model's is {list(ckpt.shapes[name])}"
        want = torch.Size(folders.shard_shape(dim, lo, hi, tuple(full)))
        if problem is None and any(shape != want for shape in shapes):
            problem = f"its {name} is {[list(shape) for shape in shapes]} (tensor, moments), not {list(want)}"
        if problem:
            raise damaged(problem)
    return saved


def _assemble(
    files: Iterable[dict], ranges: Mapping[str, tuple[int, int] | None], keys: tuple[str, ...], folder: Path
) -> dict[str, dict[str, torch.Tensor]]:
    """For each name in ``ranges``, its [lo, hi) slice along its shard dim (None: the full tensor) of each of
    ``keys``, copied from the overlapping shards of ``folder``'s rank files."""
    out: dict[str, dict[str, torch.Tensor]] = {key: {} for key in keys}
    covered: dict[str, torch.Tensor] = {}  # name -> which of its [lo, hi) rows some saved shard filled
    for saved in files:
        for name, shard in saved["shards"].items():
            if name not in ranges:
                continue
            dim, shard_lo, shard_hi, shape = shard["coords"]
            dim = 0 if dim is None else dim  # a replicated tensor: the whole of dim 0
            lo, hi = ranges[name] or (0, shape[dim])
            if name not in covered:
                size = tuple(hi - lo if d == dim else n for d, n in enumerate(shape))
                for key in keys:
                    out[key][name] = torch.empty(size)
                covered[name] = torch.zeros(hi - lo, dtype=torch.bool)
            a, b = max(lo, shard_lo), min(hi, shard_hi)
            if a >= b:
                continue
            for key in keys:
                out[key][name].narrow(dim, a - lo, b - a).copy_(shard[key].narrow(dim, a - shard_lo, b - a))
            covered[name][a - lo : b - lo] = True
    for name in ranges:
        if name not in covered or not covered[name].all():
            raise CheckpointError(
                str(folder),
                "--resume",
                f"{name}: part of it is in no rank file (the save is damaged); resume from another step folder",
            )
    return out


def load_full_params(directory: str, progress: bool = False) -> dict[str, torch.Tensor]:
    """Full (one-process) parameters from any layout's save: a step folder, or a checkpoint root's newest; read
    and refused (damaged shards, NaN) as a resumed rank reads its own. ``progress``: show the rank files read on a
    terminal."""
    ckpt = folders.find(directory)
    files = (_load_rank_file(ckpt, r) for r in range(ckpt.world_size))
    with _loading(ckpt, progress) as bar:
        shards = _assemble(_read_through(files, ckpt, bar), dict.fromkeys(ckpt.shapes), ("tensor",), ckpt.path)
    _check_finite(shards, ckpt.path)
    return shards["tensor"]


def _loading(ckpt: Checkpoint, progress: bool) -> Bar:
    total = sum(ckpt.rank_file(r).stat().st_size for r in range(ckpt.world_size))
    return Bar(f"loading {ckpt.path}", total, "B", enabled=None if progress else False)


def _read_through(files: Iterable[dict], ckpt: Checkpoint, bar: Bar) -> Iterator[dict]:
    """``files`` (rank 0's first), each counted on ``bar`` (by its size on disk) once its slices are copied out."""
    for rank, saved in enumerate(files):
        yield saved
        bar.update(ckpt.rank_file(rank).stat().st_size)
