"""The schedule IR: action kinds, actions and their compact reversible string form, and the grid printer.

An ``Action`` is one step on one stage (``F3``, ``B3``, ``W3``, ``SEND_F3``, ``RECV_B0.2``, ...);
``str`` and ``Action.parse`` are inverses. A schedule is one list of actions per stage (``ActionLists``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence

import attrs

from hetero_llm.errors import ScheduleError


class Kind(enum.Enum):
    """What an action does; the value is its prefix in the string form."""

    F = "F"  # forward of one microbatch
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # input gradient only (zero-bubble); its W follows later
    W = "W"  # weight gradient only, of a microbatch whose I has run
    SEND_F = "SEND_F"  # send the forward activation to the next stage (non-blocking)
    RECV_F = "RECV_F"  # receive the forward activation from the previous stage (blocking)
    SEND_B = "SEND_B"  # send the input gradient to the previous stage (non-blocking)
    RECV_B = "RECV_B"  # receive the output gradient from the next stage (blocking)
    RS = "RS"  # ZeRO-1: start reduce-scattering the stage's gradient blocks (non-blocking), after its last backward
    AG = "AG"  # ZeRO-1: wait for the all-gather of the parameters the last step updated, before the first forward

    @property
    def direction(self) -> Direction | None:
        """The way a communication action's data goes (``SEND_F``/``RECV_F``: FWD); None for the others."""
        return _DIRECTIONS.get(self)


class Direction(enum.IntEnum):
    """Which way data crosses a stage boundary: ``FWD`` carries activations to the next virtual stage, ``BWD``
    their gradients back. The value is part of p2p message tags and shared-memory ring names."""

    FWD = 0
    BWD = 1

    @property
    def label(self) -> str:
        """``"fwd"`` / ``"bwd"``: how p2p group names spell it (``plan.rank.P2PKey.name``)."""
        return self.name.lower()

    @property
    def send(self) -> Kind:
        return Kind.SEND_F if self is Direction.FWD else Kind.SEND_B

    @property
    def recv(self) -> Kind:
        return Kind.RECV_F if self is Direction.FWD else Kind.RECV_B


_DIRECTIONS = {
    Kind.SEND_F: Direction.FWD,
    Kind.RECV_F: Direction.FWD,
    Kind.SEND_B: Direction.BWD,
    Kind.RECV_B: Direction.BWD,
}

COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
BACKWARD_KINDS = frozenset({Kind.B, Kind.I})  # the actions that produce a microbatch's input gradient
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
OPTIMIZER_KINDS = frozenset({Kind.RS, Kind.AG})  # one each per stage and step, written with microbatch 0


# Canonical form only (no leading zeros, no ".0"), so that str(parse(s)) == s for every accepted s
# and two equal actions always print the same.
_ACTION_RE = re.compile(
    r"(?P<kind>SEND_F|RECV_F|SEND_B|RECV_B|RS|AG|F|B|I|W)(?P<mb>0|[1-9]\d*)(?:\.(?P<chunk>[1-9]\d*))?"
)
_KINDS_HELP = ", ".join(kind.value for kind in Kind)


@attrs.frozen(repr=False)
class Action:
    """One schedule step on one stage.

    ``mb`` is the microbatch index (0-based); ``chunk`` is the model chunk on this stage (the
    virtual stage index of an interleaved schedule; 0 for non-interleaved schedules).
    """

    kind: Kind = attrs.field(validator=attrs.validators.instance_of(Kind))
    mb: int = attrs.field(validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)])
    chunk: int = attrs.field(default=0, validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)])

    def __str__(self) -> str:
        suffix = f".{self.chunk}" if self.chunk else ""
        return f"{self.kind.value}{self.mb}{suffix}"

    def __repr__(self) -> str:
        # Compact in pytest diffs and still evaluable.
        return f"Action.parse({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``"F3"``, ``"SEND_B0.2"``; raises ScheduleError on anything else."""
        match = _ACTION_RE.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(
                f"bad action {text!r}: expected KIND MB[.CHUNK] in canonical form, KIND one of "
                f"{_KINDS_HELP} (e.g. 'F3', 'SEND_B0.2'; chunk 0 is written without '.0')"
            )
        chunk = match["chunk"]
        return cls(Kind(match["kind"]), int(match["mb"]), int(chunk) if chunk else 0)


Event = tuple[int, Action]
"""``(stage, action)``: "this action has run on this stage"; the unit of dependencies."""

ActionLists = list[list[Action]]
"""One list of actions per stage, indexed by stage: a schedule as generators, lowering and files return it.
(Not ``layout.Schedule``, the enum of schedule kinds a layout names.)"""


def format_actions(actions: Iterable[Action]) -> str:
    """``[F0, F1, B0]`` -> ``"F0 F1 B0"``."""
    return " ".join(str(action) for action in actions)


def parse_actions(text: str) -> list[Action]:
    """Inverse of ``format_actions``: whitespace-separated actions."""
    actions = []
    for position, token in enumerate(text.split()):
        try:
            actions.append(Action.parse(token))
        except ScheduleError as error:
            raise ScheduleError(f"action {position}: {error}") from None
    return actions


def num_chunks(schedule: Sequence[Sequence[Action]]) -> int:
    """Model chunks per stage: ``1 + the largest chunk index`` (1 for a linear pipeline)."""
    return 1 + max((action.chunk for actions in schedule for action in actions), default=0)


def first_virtual(stage: int, chunk: int) -> bool:
    return stage == 0 and chunk == 0


def last_virtual(stage: int, chunk: int, num_stages: int, chunks: int) -> bool:
    return stage == num_stages - 1 and chunk == chunks - 1


def is_lowered(schedule: Sequence[Sequence[Action]]) -> bool:
    return any(action.kind in COMM_KINDS for actions in schedule for action in actions)


_MARK = " <-- ERROR HERE"


def format_grid(schedule: Sequence[Sequence[Action]], mark: dict[int, int] | None = None) -> str:
    """A table with one column per stage and one row per action index.

    ``mark={stage: index}`` appends ``<-- ERROR HERE`` to those cells; columns stay aligned.
    """
    mark = mark or {}
    num_rows = max((len(actions) for actions in schedule), default=0)
    columns = []
    for stage, actions in enumerate(schedule):
        cells = [str(action) for action in actions] + [""] * (num_rows - len(actions))
        if stage in mark and 0 <= mark[stage] < num_rows:
            cells[mark[stage]] += _MARK
        columns.append([f"stage {stage}"] + cells)
    labels = ["step"] + [str(index) for index in range(num_rows)]
    widths = [max(len(cell) for cell in column) for column in [labels] + columns]
    lines = []
    for row, label in enumerate(labels):
        cells = [label.rjust(widths[0])]
        cells += [column[row].ljust(width) for column, width in zip(columns, widths[1:])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
