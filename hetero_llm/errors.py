"""Library error types. The CLI turns a ``LayoutError`` (``CheckpointError`` included) into one line and exit code 2."""

from __future__ import annotations

ENVIRONMENT = "environment"  # the "file" a LayoutError about an environment variable names


class HeteroError(Exception):
    """Base class for errors this library raises on purpose."""


class LayoutError(HeteroError):
    """Bad user input, located: ``file: toml.path: what is wrong (and the fix)``."""

    def __init__(self, file: str, path: str, message: str):
        self.file = str(file)
        self.path = path
        self.message = message
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.file}: {self.path}" if self.path else self.file
        return f"{where}: {self.message}"


class CheckpointError(LayoutError):
    """A checkpoint that cannot be resumed, located like bad layout: ``DIR: --resume: what is wrong (and the fix)``."""


class ScheduleError(HeteroError):
    """An invalid or deadlocking schedule; the message carries the schedule grid.

    ``stage`` and ``step`` say where: the stage (index into the action lists) and the step (index into that
    stage's list) the message is about, or None where it is about no one stage or step. A schedule file maps
    them to its own line, so no one re-reads the message to find them.
    """

    def __init__(self, message: str, stage: int | None = None, step: int | None = None):
        super().__init__(message)
        self.stage = stage
        self.step = step


class RankFailure(HeteroError):
    """A rank of a running job failed; the message names the rank and its cause."""

    exit_code = 1


class Diverged(RankFailure):
    """The loss or the gradient norm became NaN or infinite. Both are all-reduced, so every rank sees it at
    the same step and stops there, before the optimizer step and before any save."""

    exit_code = 3
