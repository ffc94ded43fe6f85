"""The training loop's checkpoint glue: where a rank's starting state comes from (a save, a Hugging Face model,
or the seed) and when it saves (checkpoint/ does the writing and reading)."""

from __future__ import annotations

import shutil
from pathlib import Path

import attrs
import torch

from hetero_llm.checkpoint import folders
from hetero_llm.checkpoint.shards import Restored, restore, restore_optimizer, save_checkpoint
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

    def due(self, done: int) -> bool:
        return bool(self.root) and (done == self.rp.train.steps or bool(self.every) and done % self.every == 0)

    def save(self, state: RankState, optimizer, done: int):
        save_checkpoint(self.rp, state, optimizer, self.root, done, progress=self.progress)
        self.last = folders.step_folder(self.root, done)
        return self.last

    def snapshot_due(self, done: int) -> bool:
        return bool(self.snapshot_root) and bool(self.snapshot_every) and done % self.snapshot_every == 0

    def snapshot(self, state: RankState, optimizer, done: int) -> None:
        """A save into the snapshot folder (the same format); once it is complete, rank 0 removes the older ones."""
        assert self.snapshot_root is not None
        save_checkpoint(self.rp, state, optimizer, self.snapshot_root, done)
        if self.rp.rank == 0:
            for folder in Path(self.snapshot_root).glob(f"{folders.STEP_PREFIX}*"):
                if folder.name < folders.step_folder(self.snapshot_root, done).name:
                    shutil.rmtree(folder, ignore_errors=True)
