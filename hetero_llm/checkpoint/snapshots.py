"""In-memory snapshots of an elastic run (``--snapshot-every K``): written in the background, resumed by holders.

A snapshot is taken at a step boundary as a CPU copy of the rank's parameters and AdamW moments (synchronous and
cheap), then written by a background thread while the next steps compute; at most one write is in flight per rank
(the next snapshot waits for it). Nothing in the write is collective: each rank writes, into its round's folder,

    ROUND/step-NNNNNN/rank{R}.pt     its shards (the checkpoint format of ``shards.save_checkpoint``)
    ROUND/step-NNNNNN/rank{R}.json   written after the .pt (both atomically): what it holds, its size and sha256,
                                     and their MAC under the run's key (``checkpoint.trust``)

so a ``.json`` vouches for a whole ``.pt``, and only the run's key makes one that is believed. The folders are
made 0700, the files 0600: no other user reads the weights or moments. Each rank keeps its two newest snapshots
(``--keep-last N`` under ``--elastic``: N; a peer may be one snapshot behind when a node is lost), and as many of
each replica it keeps. ``ROUND`` is one per round (``<plan fingerprint>-<start
step>``): files of different layouts are never mixed. What a restart makes of them, over every node's folder: ``checkpoint.holders``.
When the ranks run on several nodes, each snapshot is also sent to a rank of another node, which keeps it in its
node's folder (``checkpoint.replicas``): losing any one node leaves every block with a holder.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import threading
from pathlib import Path

import attrs
import torch

from hetero_llm._fs import write_atomically
from hetero_llm.checkpoint import folders, replicas, trust
from hetero_llm.checkpoint.shards import MOMENTS, optimizer_steps
from hetero_llm.errors import RankFailure
from hetero_llm.plan.rank import RankPlan
from hetero_llm.runtime import zero1

KEEP = folders.SNAPSHOTS_KEPT  # snapshots each rank keeps by default


@attrs.define
class SnapshotWriter:
    """One rank's snapshots into ``root`` (its round's folder), written by a background thread."""

    rp: RankPlan
    root: Path
    key: bytes  # the run's snapshot key (``trust.run_key``): every record carries its MAC
    thread: threading.Thread | None = None
    failure: str | None = None  # why the last write failed (raised at the next step boundary)
    written: list[int] = attrs.field(factory=list)  # steps of this rank's complete snapshots, oldest first
    keep: int = KEEP  # snapshots kept (--keep-last N with --elastic)
    group: object = None  # the replicas' gloo group (None: no replicas, the plan's ranks are on one node)
    kept: dict[int, list[int]] = attrs.field(factory=dict)  # source rank -> steps of its replicas held, oldest first
    local: threading.Event = attrs.field(factory=threading.Event)  # this rank's own file of the write is written

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
        self.local = threading.Event()
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

    def wait_local(self, timeout_s: float) -> None:
        """On the way out of a failure: until this rank's own file is written (not its replica exchange, which
        waits on peers that may be gone), at most ``timeout_s``."""
        if self.thread is not None:
            self.local.wait(timeout_s)

    def _write(self, saved: dict, step: int) -> None:
        folder = folders.step_folder(self.root, step)
        try:
            trust.private_folder(self.root.parent)  # checked again: a round's choice may have removed it
            buffer = io.BytesIO()
            torch.save(saved, buffer)
            pt = buffer.getvalue()
            record: dict = {
                "step": step,
                "world_size": self.rp.world_size,
                "bytes": len(pt),
                "sha256": hashlib.sha256(pt).hexdigest(),
                "shards": {name: shard["coords"] for name, shard in saved["shards"].items()},
            }
            record["mac"] = trust.sign(self.key, record, trust.place(self.root.name, step, self.rp.rank))
            text = json.dumps(record).encode()
            self._put(step, self.rp.rank, pt, text)
            self.written.append(step)
            while len(self.written) > self.keep:
                self._drop(self.written.pop(0), self.rp.rank)
        except BaseException as e:
            self.failure = (
                f"rank {self.rp.rank} ({self.rp.info.device_id}) could not write its snapshot of step {step} into "
                f"{folder}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (free memory in "
                f"{self.root.parent.parent} or set HETERO_SHM_DIR to another folder)"
            )
        finally:
            self.local.set()
        if self.group is not None and self.failure is None:
            try:
                self._exchange(step, pt, text)
            except BaseException as e:  # a peer gone (its gloo connection closed), or a replica refused
                self.failure = (
                    f"rank {self.rp.rank} ({self.rp.info.device_id}) could not exchange the replicas of its snapshot "
                    f"of step {step} with the other nodes: {type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}"
                )

    def _put(self, step: int, rank: int, pt: bytes, record: bytes) -> None:
        """Write rank ``rank``'s snapshot of ``step`` (its file, then its record: both atomically) into the round."""
        folder = folders.step_folder(self.root, step)
        for d in (self.root, folder):
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, trust.FOLDER_MODE)
        path = folders.rank_file(folder, rank)
        write_atomically(path, lambda f: f.write(pt), trust.FILE_MODE)
        write_atomically(path.with_suffix(".json"), lambda f: f.write(record), trust.FILE_MODE)

    def _drop(self, step: int, rank: int) -> None:
        old = folders.rank_file(folders.step_folder(self.root, step), rank)
        old.with_suffix(".json").unlink(missing_ok=True)  # the record first: no record vouches for nothing
        old.unlink(missing_ok=True)
        _rmdir(old.parent)

    def _exchange(self, step: int, pt: bytes, record: bytes) -> None:
        """This snapshot to its keeper, the snapshots this rank keeps from other nodes' ranks into this node's
        folder (each checked against its record first), the ``keep`` newest per rank."""
        kept = replicas.keepers(self.rp.peers)
        got = replicas.exchange(self.group, kept.get(self.rp.rank), replicas.sources(kept, self.rp.rank), pt, record)
        for source, (their_pt, their_record) in got.items():
            replicas.check_received(self.key, trust.place(self.root.name, step, source), their_pt, their_record)
            self._put(step, source, their_pt, their_record)
            steps = self.kept.setdefault(source, [])
            steps.append(step)
            while len(steps) > self.keep:
                self._drop(steps.pop(0), source)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy that later steps do not change (``.cpu()`` of a CPU tensor is the tensor itself)."""
    return t.detach().to("cpu", copy=True)


def _rmdir(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # not empty (another rank's files) or gone
        pass
