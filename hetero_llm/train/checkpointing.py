"""The training loop's checkpoint glue: where a rank's starting state comes from (a save, a Hugging Face model,
or the seed) and when it saves (checkpoint/ does the writing and reading)."""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

from hetero_llm.checkpoint import folders, replicas, trust
from hetero_llm.checkpoint.shards import Restored, restore, restore_optimizer, save_checkpoint
from hetero_llm.checkpoint.snapshots import SnapshotWriter
from hetero_llm.interop import hf
from hetero_llm.plan.rank import RankPlan
from hetero_llm.runtime.state import RankState, init_state


def starting_state(
    rp: RankPlan, device: torch.device, resume: str | None, progress: bool
) -> tuple[RankState, Restored | None]:
    """The rank's shards: cut from the save ``resume`` names, else read from ``model.init_from`` (this rank's
    slices only), else initialized from the seed; and what was restored (its optimizer moments, its step)."""
    restored = restore(rp, resume, progress=progress) if resume else None
    if restored:
        initial = restored.shards["tensor"]
    elif rp.model.init_from:
        initial = hf.load_shards(rp.model, rp.params_of())
    else:
        initial = None
    return init_state(rp, device, initial), restored


def restore_moments(optimizer, state: RankState, restored: Restored | None) -> None:
    if restored:
        restore_optimizer(optimizer, state.params, restored.shards, restored.optimizer_steps)


@attrs.define
class Saver:
    """Saves into ``root`` every ``every`` steps (0: at the end only) and at the last step."""

    rp: RankPlan
    root: str | None
    every: int
    progress: bool  # bars on the reporting rank's terminal
    last: object = None  # the newest complete save (a step folder), for the divergence message
    snapshot_root: str | None = None  # also save here every snapshot_every steps (elastic runs: node memory)
    snapshot_every: int = 0
    snapshots: SnapshotWriter | None = None  # the background writer, once a snapshot was taken
    keep: int = 0  # --keep-last: complete saves kept (0: all)
    keep_snapshots: int = 2  # snapshots each rank keeps
    resumed: object = None  # the save this run resumed from: never pruned

    def due(self, done: int) -> bool:
        return bool(self.root) and (done == self.rp.train.steps or bool(self.every) and done % self.every == 0)

    def save(self, state: RankState, optimizer, done: int):
        assert self.root is not None  # due() only with a root
        protect = [str(self.resumed)] if self.resumed else []
        save_checkpoint(self.rp, state, optimizer, self.root, done, self.progress, self.keep, protect)
        self.last = folders.step_folder(self.root, done)
        return self.last

    def snapshot_due(self, done: int) -> bool:
        return bool(self.snapshot_root) and bool(self.snapshot_every) and done % self.snapshot_every == 0

    def snapshot(self, state: RankState, optimizer, done: int) -> None:
        """Copy the rank's state now and write it into the snapshot folder in the background
        (``checkpoint.snapshots``); the previous snapshot's write is waited for first."""
        assert self.snapshot_root is not None
        if self.snapshots is None:
            assert self.root is not None  # --snapshot-every needs --elastic, which needs --checkpoint DIR
            key = trust.run_key(self.root)
            self.snapshots = SnapshotWriter(self.rp, Path(self.snapshot_root), key, keep=self.keep_snapshots)
            self.snapshots.group = _replica_group(self.rp)  # collective: every rank takes its first snapshot now
        self.snapshots.take(state, optimizer, done)

    def check_snapshot(self) -> None:
        """Raise, naming the rank, if a background snapshot write failed."""
        if self.snapshots is not None:
            self.snapshots.check()

    def finish_snapshots(self, raise_failure: bool = True) -> None:
        """Wait for the snapshot write in flight (at the end of training, or on the way out of a failure)."""
        if self.snapshots is not None:
            if not raise_failure:  # a failure: this rank's own file, not the replicas' exchange with peers gone
                self.snapshots.wait_local(max(self.rp.network.timeout_s, 30))
                return
            self.snapshots.wait()


def _replica_group(rp: RankPlan):
    """The gloo group of every rank that the snapshots' replicas travel over (``checkpoint.replicas``), or None
    when the plan's ranks run on one node (no replica)."""
    if not replicas.keepers(rp.peers):
        return None
    from datetime import timedelta

    from hetero_llm.comm import groups

    timeout = timedelta(seconds=max(rp.network.timeout_s, 30))  # as the plan's groups' (comm/groups.py)
    return groups.gloo_world_group(rp, timeout)
