"""Pipeline schedules as data: actions, generators, lowering, validator and lockstep simulator.

A schedule is one list of actions per **stage** (every TP rank of a stage runs the same list),
indexed by stage. Generators (``gpipe``, ``one_f_one_b``, ``interleaved_1f1b``, ``zero_bubble_h1``)
emit compute-only schedules (``F``/``B``, or ``F``/``I``/``W``); ``lower`` adds the communication (``SEND_F``/``RECV_F``/``SEND_B``/
``RECV_B``); ``validate`` checks a schedule statically and then runs all stages in a lockstep
simulation to find deadlocks. Errors carry the schedule grid with the failing step marked
``<-- ERROR HERE``. ``load_schedule_file`` reads a user-written schedule.

Chunks (interleaved, "virtual" stages): with ``chunks`` model chunks per stage, chunk c of stage s
is virtual stage ``v = c * num_stages + s``, and data flows through virtual stages in order. So the
last stage's chunk c sends forward to stage 0's chunk c + 1 (the *wrap*), and backward the reverse.
The number of chunks of a schedule is ``1 + its largest chunk index`` (``num_chunks``); a schedule
whose actions are all chunk 0 is an ordinary linear pipeline.

Semantics (the runtime implements exactly these):

- ``SEND`` is non-blocking; ``RECV`` blocks until the neighbouring virtual stage has issued the
  matching ``SEND`` (``SEND_F m.c`` on virtual stage v-1 -> ``RECV_F m.c'`` on v;
  ``SEND_B`` on v+1 -> ``RECV_B`` on v; same microbatch; ``peer`` gives the exact match).
- A backward is either one ``B m`` (input and weight gradients) or split in two (zero-bubble):
  ``I m`` computes only the input gradient, which the previous stage waits for, and ``W m`` the
  weight gradient, which nobody waits for and so can fill a bubble. "The input gradient of m" is
  the event ``I m``; a ``B m`` produces it too.
- ``F m`` needs ``RECV_F m`` earlier on its stage unless it is the first virtual stage; ``B m`` and
  ``I m`` need ``F m`` and, unless it is the last virtual stage, ``RECV_B m``; ``SEND_F m`` needs
  ``F m``; ``SEND_B m`` and ``W m`` need the input gradient ``I m`` (all same chunk).
- A schedule without any communication action is read as compute-only: the data dependency is
  then direct (``F m`` on v needs ``F m`` on v-1; ``B m`` or ``I m`` on v needs the input gradient
  of m on v+1), so generator output can be validated before lowering.

Pure standard library + attrs: no torch, so planning, dry runs and tests run anywhere.
"""

from __future__ import annotations

import csv
import enum
import io
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

from hetero_llm.errors import ScheduleError

__all__ = [
    "BACKWARD_KINDS",
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "OPTIMIZER_KINDS",
    "Action",
    "Event",
    "Kind",
    "Schedule",
    "add_optimizer_actions",
    "build",
    "check_message_order",
    "compute_schedule",
    "format_actions",
    "format_grid",
    "gpipe",
    "interleaved_1f1b",
    "load_schedule_file",
    "lower",
    "num_chunks",
    "one_f_one_b",
    "parse_actions",
    "peer",
    "produces",
    "requirements",
    "simulate_order",
    "validate",
    "zero_bubble_h1",
]


class Kind(enum.Enum):
    """What an action does; the value is its prefix in the string form."""

    F = "F"  # forward of one microbatch
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # input gradient only (zero-bubble); its W follows later  # noqa: E741
    W = "W"  # weight gradient only, of a microbatch whose I has run
    SEND_F = "SEND_F"  # send the forward activation to the next stage (non-blocking)
    RECV_F = "RECV_F"  # receive the forward activation from the previous stage (blocking)
    SEND_B = "SEND_B"  # send the input gradient to the previous stage (non-blocking)
    RECV_B = "RECV_B"  # receive the output gradient from the next stage (blocking)
    RS = "RS"  # ZeRO-1: start reduce-scattering the stage's gradient blocks (non-blocking), after its last backward
    AG = "AG"  # ZeRO-1: wait for the all-gather of the parameters the last step updated, before the first forward


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
BACKWARD_KINDS = frozenset({Kind.B, Kind.I})  # the actions that produce a microbatch's input gradient
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
OPTIMIZER_KINDS = frozenset({Kind.RS, Kind.AG})  # one each per stage and step, written with microbatch 0

# For each communication kind: the virtual-stage offset of its peer and the kind the peer runs.
_PEER = {
    Kind.SEND_F: (+1, Kind.RECV_F),
    Kind.RECV_F: (-1, Kind.SEND_F),
    Kind.SEND_B: (-1, Kind.RECV_B),
    Kind.RECV_B: (+1, Kind.SEND_B),
}

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
    chunk: int = attrs.field(
        default=0, validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)]
    )

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

Schedule = list[list[Action]]


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


# --------------------------------------------------------------------------- generators


def _check_counts(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"need num_stages >= 1 and num_microbatches >= 1, "
            f"got num_stages={num_stages}, num_microbatches={num_microbatches}"
        )


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards, both in microbatch order.

    Simple, but holds the activations of all microbatches at once.
    """
    _check_counts(num_stages, num_microbatches)
    forwards = [Action(Kind.F, mb) for mb in range(num_microbatches)]
    backwards = [Action(Kind.B, mb) for mb in range(num_microbatches)]
    return [forwards + backwards for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Non-interleaved 1F1B (PipeDream-flush), compute only.

    Stage s runs ``warmup = min(num_stages - s - 1, M)`` forwards, then alternates F then B
    until every forward has run, then the remaining backwards. This is the order of PyTorch's
    ``Schedule1F1B`` (which counts ``num_stages - s`` warmup forwards and then alternates B, F),
    and it caps the microbatches in flight on stage s at ``num_stages - s``.
    """
    _check_counts(num_stages, num_microbatches)
    return [
        _one_f_one_b_stage(min(num_stages - stage - 1, num_microbatches), num_microbatches)
        for stage in range(num_stages)
    ]


def _one_f_one_b_stage(warmup: int, num_microbatches: int) -> list[Action]:
    actions = [Action(Kind.F, mb) for mb in range(warmup)]
    for step in range(num_microbatches - warmup):
        actions += [Action(Kind.F, warmup + step), Action(Kind.B, step)]
    actions += [Action(Kind.B, mb) for mb in range(num_microbatches - warmup, num_microbatches)]
    return actions


def interleaved_1f1b(num_stages: int, num_microbatches: int, chunks: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline), compute only.

    Every stage holds ``chunks`` model chunks; chunk c of stage s is virtual stage
    ``c * num_stages + s``. Each stage runs ``chunks * M`` forwards and as many backwards. The k-th
    forward of a stage belongs to chunk ``(k mod (S * chunks)) // S`` and microbatch
    ``(k // (S * chunks)) * S + k mod S``: groups of S microbatches go through chunk 0, then the same
    group through chunk 1, and so on. Backwards visit chunks in reverse. Stage s runs
    ``warmup = min(2 * (S - s - 1) + (chunks - 1) * S, chunks * M)`` forwards, then alternates F then B,
    then the remaining backwards (Megatron-LM's ``forward_backward_pipelining_with_interleaving``).

    With equal stage times and free communication the bubble shrinks from 1F1B's
    ``(S - 1) / (M + S - 1)`` to ``(S - 1) / (chunks * M + S - 1)``, for ``chunks`` times as many
    messages. Needs ``num_microbatches % num_stages == 0``.
    """
    _check_counts(num_stages, num_microbatches)
    if chunks < 1:
        raise ValueError(f"need chunks >= 1, got chunks={chunks}")
    if num_microbatches % num_stages:
        multiple = num_microbatches + num_stages - num_microbatches % num_stages
        raise ValueError(
            f"interleaved 1F1B needs num_microbatches to be a multiple of num_stages, got "
            f"num_microbatches={num_microbatches}, num_stages={num_stages} (e.g. {multiple})"
        )
    total = chunks * num_microbatches
    group = num_stages * chunks

    def forward(k: int) -> Action:
        return Action(Kind.F, (k // group) * num_stages + k % num_stages, (k % group) // num_stages)

    def backward(k: int) -> Action:
        chunk = chunks - 1 - (k % group) // num_stages
        return Action(Kind.B, (k // group) * num_stages + k % num_stages, chunk)

    schedule = []
    for stage in range(num_stages):
        warmup = min(2 * (num_stages - stage - 1) + (chunks - 1) * num_stages, total)
        actions = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(warmup + k), backward(k)]
        actions += [backward(k) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), compute only.

    The backward is split: ``I m`` (input gradient) is what the previous stage waits for, ``W m``
    (weight gradient) waits for nobody. Stage s runs 1F1B's order of forwards and input gradients
    (``F`` then ``I`` in the steady state) and puts each ``W`` right after an ``I``, but ``s`` input
    gradients late: the later a stage, the sooner its input gradients reach the stages before it,
    and its ``s`` delayed ``W`` fill the end of the step, where 1F1B idles. With F = I = W the bubble
    shrinks from 1F1B's ``(S - 1)(F + I + W)`` to ``(S - 1)(F + I - W)``: a third. The cost is memory:
    stage s keeps what the ``W`` need (layer inputs and output gradients) for ``s`` more microbatches,
    so every stage peaks at S microbatches in flight, stage 0's 1F1B peak (torch's ZB1P order).
    """
    _check_counts(num_stages, num_microbatches)
    schedule = []
    for stage in range(num_stages):
        actions: list[Action] = []
        weights = 0  # W actions placed so far, in microbatch order
        for action in _one_f_one_b_stage(min(num_stages - stage - 1, num_microbatches), num_microbatches):
            if action.kind is Kind.F:
                actions.append(action)
                continue
            actions.append(Action(Kind.I, action.mb))
            if action.mb >= stage:
                actions.append(Action(Kind.W, weights))
                weights += 1
        actions += [Action(Kind.W, mb) for mb in range(weights, num_microbatches)]
        schedule.append(actions)
    return schedule


_GENERATORS = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zbh1": zero_bubble_h1}


def compute_schedule(
    kind: str, num_stages: int, num_microbatches: int, *, chunks: int = 1
) -> Schedule:
    """Compute-only schedule of the named kind: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zbh1"``.

    ``chunks`` is the number of model chunks per stage; only ``"interleaved"`` takes more than 1.
    """
    try:
        generator = _GENERATORS[kind]
    except KeyError:
        raise ValueError(
            f"unknown schedule {kind!r} (known: {', '.join(sorted(_GENERATORS))})"
        ) from None
    if kind == "interleaved":
        return interleaved_1f1b(num_stages, num_microbatches, chunks)
    if chunks != 1:
        raise ValueError(f"schedule {kind!r} has one chunk per stage, got chunks={chunks}")
    return generator(num_stages, num_microbatches)


def num_chunks(schedule: Sequence[Sequence[Action]]) -> int:
    """Model chunks per stage: ``1 + the largest chunk index`` (1 for a linear pipeline)."""
    return 1 + max((action.chunk for actions in schedule for action in actions), default=0)


def _first_virtual(stage: int, chunk: int) -> bool:
    return stage == 0 and chunk == 0


def _last_virtual(stage: int, chunk: int, num_stages: int, chunks: int) -> bool:
    return stage == num_stages - 1 and chunk == chunks - 1


def lower(compute: Sequence[Sequence[Action]], chunks: int | None = None) -> Schedule:
    """Add the communication to a compute-only schedule (linear, or interleaved with chunks).

    Receives go right before the compute that needs them and sends right after the compute that
    produces them, so each stage blocks as late and sends as early as its own order allows.
    ``chunks`` defaults to ``num_chunks(compute)``.
    """
    num_stages = len(compute)
    chunks = num_chunks(compute) if chunks is None else chunks
    lowered = []
    for stage, actions in enumerate(compute):
        out: list[Action] = []
        for action in actions:
            if action.kind in COMM_KINDS:
                raise ScheduleError(
                    f"lower: stage {stage} already has communication ({action}); "
                    "lower takes a compute-only schedule"
                )
            if action.chunk >= chunks:
                raise ScheduleError(
                    f"lower: stage {stage}: {action} names chunk {action.chunk}, "
                    f"but there are {chunks} chunks (0..{chunks - 1})"
                )
            same = (action.mb, action.chunk)
            first = _first_virtual(stage, action.chunk)
            last = _last_virtual(stage, action.chunk, num_stages, chunks)
            if action.kind is Kind.F:
                out += [] if first else [Action(Kind.RECV_F, *same)]
                out += [action]
                out += [] if last else [Action(Kind.SEND_F, *same)]
            elif action.kind in BACKWARD_KINDS:
                out += [] if last else [Action(Kind.RECV_B, *same)]
                out += [action]
                out += [] if first else [Action(Kind.SEND_B, *same)]
            else:
                out.append(action)
        lowered.append(out)
    return lowered


def add_optimizer_actions(schedule: Sequence[Sequence[Action]]) -> Schedule:
    """ZeRO-1's actions on every stage: ``AG0`` right before its first forward (the parameter all-gather
    started after the last step's update must be done there, and only there), ``RS0`` at the end, after its
    last backward (its reduce-scatters then overlap the other stages' remaining work)."""
    out = []
    for actions in schedule:
        actions = list(actions)  # a schedule file may place either itself: only what is missing is added
        if Action(Kind.AG, 0) not in actions:
            first_f = next(i for i, a in enumerate(actions) if a.kind is Kind.F)
            actions.insert(first_f, Action(Kind.AG, 0))
        if Action(Kind.RS, 0) not in actions:
            actions.append(Action(Kind.RS, 0))
        out.append(actions)
    return out


def build(kind: str, num_stages: int, num_microbatches: int, *, chunks: int = 1) -> Schedule:
    """The runnable schedule: ``lower(compute_schedule(kind, num_stages, num_microbatches))``."""
    return lower(compute_schedule(kind, num_stages, num_microbatches, chunks=chunks), chunks)


# --------------------------------------------------------------------------- dependencies


def requirements(
    stage: int, action: Action, num_stages: int, *, lowered: bool = True, chunks: int = 1
) -> tuple[Event, ...]:
    """The events that must have run before ``action`` can run on ``stage``.

    This is the single statement of the semantics: the validator, the lockstep simulator and the
    cost-model simulator all read dependencies from here. ``lowered=False`` reads a compute-only
    schedule, where the cross-stage data dependency is direct instead of through SEND/RECV.
    ``chunks`` is the schedule's number of model chunks per stage (``num_chunks``).
    """
    same = (action.mb, action.chunk)
    kind = action.kind
    first = _first_virtual(stage, action.chunk)
    last = _last_virtual(stage, action.chunk, num_stages, chunks)
    if kind is Kind.F:
        if first:
            return ()
        if lowered:
            return ((stage, Action(Kind.RECV_F, *same)),)
        return (_neighbour(stage, action, -1, num_stages, chunks),)
    if kind in BACKWARD_KINDS:
        own = (stage, Action(Kind.F, *same))
        if last:
            return (own,)
        if lowered:
            return (own, (stage, Action(Kind.RECV_B, *same)))
        return (own, _neighbour(stage, Action(Kind.I, *same), +1, num_stages, chunks))
    if kind is Kind.W or kind is Kind.SEND_B:
        return ((stage, Action(Kind.I, *same)),)  # the input gradient: from I, or from a B
    if kind is Kind.SEND_F:
        return ((stage, Action(Kind.F, *same)),)
    if kind in OPTIMIZER_KINDS:
        return ()  # their place on the stage is the dependency (_check_optimizer_actions)
    return (peer(stage, action, num_stages, chunks=chunks),)  # a RECV waits for its SEND


def produces(stage: int, action: Action) -> tuple[Event, ...]:
    """The events running ``action`` on ``stage`` makes true: itself, and for a ``B`` also the
    input-gradient event ``I`` that ``requirements`` names (a full backward computes it too)."""
    if action.kind is Kind.B:
        return ((stage, action), (stage, Action(Kind.I, action.mb, action.chunk)))
    return ((stage, action),)


def _neighbour(stage: int, action: Action, offset: int, num_stages: int, chunks: int) -> Event:
    """``action``'s kind on virtual stage ``v + offset``, as (stage, action).

    Off either end of the virtual pipeline this returns stage -1 or ``num_stages`` (which do not
    exist), so callers name the missing neighbour in their message.
    """
    virtual = action.chunk * num_stages + stage + offset
    if not 0 <= virtual < num_stages * chunks:
        return stage + offset, action  # no neighbour: a stage that does not exist
    chunk, other = divmod(virtual, num_stages)
    return other, Action(action.kind, action.mb, chunk)


def peer(
    stage: int, action: Action, num_stages: int | None = None, *, chunks: int = 1
) -> Event:
    """The matching action of a SEND or RECV on the neighbouring virtual stage.

    ``SEND_F m.c`` on the last stage matches ``RECV_F m.(c+1)`` on stage 0 when there are more
    chunks (the wrap of an interleaved schedule); otherwise peers are on the adjacent stage with
    the same chunk. The returned stage may not exist (-1 or ``num_stages``): callers check.
    ``num_stages`` is needed only with ``chunks > 1``.
    """
    offset, kind = _PEER[action.kind]
    if chunks == 1:
        return stage + offset, Action(kind, action.mb, action.chunk)
    if num_stages is None:
        raise ValueError(f"peer: num_stages is needed with chunks={chunks}")
    other, match = _neighbour(stage, action, offset, num_stages, chunks)
    return other, Action(kind, match.mb, match.chunk)


def _is_lowered(schedule: Sequence[Sequence[Action]]) -> bool:
    return any(action.kind in COMM_KINDS for actions in schedule for action in actions)


# --------------------------------------------------------------------------- grid


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


def _error(
    schedule: Sequence[Sequence[Action]], what: str, mark: dict[int, int] | None = None
) -> ScheduleError:
    """A ScheduleError: one line saying what is wrong, then the grid with the failing step(s)."""
    return ScheduleError(f"{what}\n{format_grid(schedule, mark)}")


# --------------------------------------------------------------------------- simulation


@attrs.frozen
class _Run:
    """What a lockstep run did: ``rounds[r]`` lists the ``(stage, index)`` that ran in round r.

    ``stuck`` maps each stage that did not finish to the index of the action it waits at.
    """

    rounds: list[list[tuple[int, int]]]
    stuck: dict[int, int]


def _lockstep(schedule: Sequence[Sequence[Action]]) -> _Run:
    """Run all stages in rounds: each stage runs actions while the next one is ready.

    A cross-stage requirement counts only if it ran in an earlier round, so the rounds do not
    depend on the order stages are visited in, and a message takes at least one round. The
    flattened rounds are a topological order of all events: every requirement of an action comes
    before it. A cost model is a fold over that order (start = max(stage free time, end of each
    requirement + its link time)), so it reuses this loop and ``requirements`` unchanged.
    """
    num_stages = len(schedule)
    lowered = _is_lowered(schedule)
    chunks = num_chunks(schedule)
    next_index = [0] * num_stages
    ran_in: dict[Event, int] = {}  # event -> round it ran in
    rounds: list[list[tuple[int, int]]] = []

    def ready(stage: int, action: Action, this_round: int) -> bool:
        return all(
            event in ran_in and (event[0] == stage or ran_in[event] < this_round)
            for event in requirements(stage, action, num_stages, lowered=lowered, chunks=chunks)
        )

    while True:
        this_round = len(rounds)
        ran: list[tuple[int, int]] = []
        for stage, actions in enumerate(schedule):
            while next_index[stage] < len(actions) and ready(
                stage, actions[next_index[stage]], this_round
            ):
                for event in produces(stage, actions[next_index[stage]]):
                    ran_in[event] = this_round
                ran.append((stage, next_index[stage]))
                next_index[stage] += 1
        if not ran:
            break
        rounds.append(ran)
    stuck = {s: i for s, i in enumerate(next_index) if i < len(schedule[s])}
    return _Run(rounds, stuck)


def _deadlock_message(schedule: Sequence[Sequence[Action]], stuck: dict[int, int]) -> str:
    """One line naming the first stuck stage, what it waits for and why that never comes."""
    num_stages = len(schedule)
    lowered = _is_lowered(schedule)
    chunks = num_chunks(schedule)
    stage, index = min(stuck.items())
    action = schedule[stage][index]
    waits = f"deadlock: stage {stage} waits at {action} (step {index})"
    for other, needed in requirements(stage, action, num_stages, lowered=lowered, chunks=chunks):
        if other == stage:
            if needed in _made_by(schedule[stage][:index]):
                continue  # already ran: actions before the stuck one all did
            # Only possible without validate's static checks (simulate_order on raw input).
            return f"{waits} for its own {_named(needed)}, which is not before it on stage {stage}"
        if not 0 <= other < num_stages:
            return f"{waits} for {_named(needed)} on stage {other}, which does not exist"
        if other not in stuck or needed not in _made_by(schedule[other][stuck[other] :]):
            if needed not in _made_by(schedule[other]):
                return f"{waits} for {_named(needed)} on stage {other}, which stage {other} never does"
            continue
        blocked = schedule[other][stuck[other]]
        full = Action(Kind.B, needed.mb, needed.chunk)
        shown = full if needed.kind is Kind.I and full in schedule[other] else needed  # name what that stage runs
        return (
            f"{waits} for {shown} on stage {other}, which never comes "
            f"(stage {other} is stuck at {blocked}, step {stuck[other]})"
        )
    return f"{waits}, which never becomes ready"


def _made_by(actions: Sequence[Action]) -> set[Action]:
    """Every event the actions produce (a ``B`` also produces its ``I``), stage left out."""
    return {made for action in actions for _, made in produces(0, action)}


def _named(event: Action) -> str:
    """An event as a message names it: the input-gradient event can come from an ``I`` or a ``B``."""
    if event.kind is Kind.I:
        return f"{event} (or {Action(Kind.B, event.mb, event.chunk)})"
    return str(event)


def _check_no_duplicates(schedule: Sequence[Sequence[Action]]) -> None:
    # Events are keyed by (stage, action): a repeated action would make them ambiguous.
    for stage, actions in enumerate(schedule):
        seen: dict[Action, int] = {}
        for index, action in enumerate(actions):
            if action in seen:
                raise _error(
                    schedule,
                    f"stage {stage} runs {action} twice (steps {seen[action]} and {index})",
                    {stage: index},
                )
            seen[action] = index


def simulate_order(schedule: Sequence[Sequence[Action]]) -> list[list[tuple[int, int]]]:
    """The lockstep order: ``result[r]`` lists the ``(stage, index)`` pairs run in round r.

    Raises ScheduleError on a repeated action or a deadlock; ``validate`` checks the rest.
    """
    _check_types(schedule)
    _check_no_duplicates(schedule)
    run = _lockstep(schedule)
    if run.stuck:
        raise _error(schedule, _deadlock_message(schedule, run.stuck), run.stuck)
    return run.rounds


# --------------------------------------------------------------------------- validator


def _check_types(schedule: Sequence[Sequence[Action]]) -> None:
    if not schedule:
        raise ScheduleError("schedule has no stages")
    for stage, actions in enumerate(schedule):
        for index, action in enumerate(actions):
            if not isinstance(action, Action):
                raise ScheduleError(
                    f"stage {stage} step {index}: {action!r} is not an Action "
                    "(use Action.parse or parse_actions for strings)"
                )


def _check_microbatches(schedule: Sequence[Sequence[Action]], num_microbatches: int) -> None:
    """Every microbatch index is in range; every stage runs, once per (mb, chunk), F and either B or
    both I and W."""
    for stage, actions in enumerate(schedule):
        for index, action in enumerate(actions):
            if action.mb >= num_microbatches:
                raise _error(
                    schedule,
                    f"stage {stage} step {index}: {action} names microbatch {action.mb}, "
                    f"but there are {num_microbatches} (0..{num_microbatches - 1})",
                    {stage: index},
                )
    chunks = num_chunks(schedule)
    rule = (f"every stage runs F and B (or I and W) exactly once per microbatch 0..{num_microbatches - 1}")
    if chunks > 1:
        rule += f" and chunk 0..{chunks - 1}"
    for stage, actions in enumerate(schedule):
        position = {action: index for index, action in enumerate(actions)}
        for chunk in range(chunks):
            for mb in range(num_microbatches):
                f, b, i, w = (Action(kind, mb, chunk) for kind in (Kind.F, Kind.B, Kind.I, Kind.W))
                if f not in position:
                    raise _error(schedule, f"stage {stage} is missing {f} ({rule})")
                if b in position and (i in position or w in position):
                    other = i if i in position else w
                    raise _error(schedule, f"stage {stage} runs both {b} and {other} (a backward is one B, "
                                 f"or an I and a W)", {stage: position[other]})
                if b not in position and i not in position:
                    missing = f"{b} (or {i} and {w})" if w in position or any(
                        a.kind is Kind.I for a in actions) else str(b)
                    raise _error(schedule, f"stage {stage} is missing {missing} ({rule})")
                if i in position and w not in position:
                    raise _error(schedule, f"stage {stage} runs {i} but never {w} (an input gradient I needs "
                                 f"its weight gradient W later)", {stage: position[i]})


def _check_dependencies(schedule: Sequence[Sequence[Action]]) -> None:
    """Own-stage requirements come earlier; cross-stage ones exist; every SEND has its RECV."""
    num_stages = len(schedule)
    lowered = _is_lowered(schedule)
    chunks = num_chunks(schedule)
    positions = [{action: index for index, action in enumerate(actions)} for actions in schedule]
    made_at = [{made: index for index, action in enumerate(actions) for _, made in produces(stage, action)}
               for stage, actions in enumerate(schedule)]
    for stage, actions in enumerate(schedule):
        for index, action in enumerate(actions):
            here = f"stage {stage} step {index}: {action}"
            if action.kind in COMM_KINDS:
                other, match = peer(stage, action, num_stages, chunks=chunks)
                if not 0 <= other < num_stages:
                    side = "previous" if other < stage else "next"
                    raise _error(
                        schedule,
                        f"{here} talks to stage {other}, but stage {stage} has no {side} stage",
                        {stage: index},
                    )
                if match not in positions[other]:
                    raise _error(
                        schedule,
                        f"{here} has no matching {match} on stage {other}",
                        {stage: index},
                    )
            for other, needed in requirements(
                stage, action, num_stages, lowered=lowered, chunks=chunks
            ):
                if other != stage:
                    continue  # cross-stage: checked above (comm) or by coverage (compute-only)
                where = made_at[stage].get(needed)
                if where is None:
                    raise _error(
                        schedule,
                        f"{here} needs {_named(needed)} first, which stage {stage} never does",
                        {stage: index},
                    )
                if where > index:
                    raise _error(
                        schedule,
                        f"{here} needs {_named(needed)} first, but {schedule[stage][where]} comes "
                        f"later (step {where})",
                        {stage: index},
                    )


def _check_optimizer_actions(schedule: Sequence[Sequence[Action]]) -> None:
    """``AG0`` (if any) comes before every forward of its stage, ``RS0`` after every backward."""
    for stage, actions in enumerate(schedule):
        for index, action in enumerate(actions):
            if action.kind not in OPTIMIZER_KINDS:
                continue
            if action.mb or action.chunk:
                raise _error(schedule, f"stage {stage} step {index}: {action}: {action.kind.value} is once per step, "
                             f"written {action.kind.value}0", {stage: index})
            wrong = (Kind.F,) if action.kind is Kind.AG else (Kind.B, Kind.I, Kind.W)
            before = actions[:index] if action.kind is Kind.AG else actions[index + 1:]
            clash = next((a for a in before if a.kind in wrong), None)
            if clash is not None:
                rule = "before the stage's first forward" if action.kind is Kind.AG else "after its last backward"
                raise _error(schedule, f"stage {stage} step {index}: {action} must come {rule} ({clash} is on the "
                             f"wrong side)", {stage: index})


def validate(schedule: Sequence[Sequence[Action]], num_microbatches: int) -> None:
    """Check a schedule completely; raise ScheduleError (what is wrong, then the grid) if not.

    Static checks first (types, repeats, F/B coverage, order on each stage, SEND/RECV pairing),
    because they give the most precise message; then a lockstep simulation of all stages finds
    deadlocks.
    """
    if num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be >= 1, got {num_microbatches}")
    _check_types(schedule)
    _check_no_duplicates(schedule)
    _check_microbatches(schedule, num_microbatches)
    _check_dependencies(schedule)
    _check_optimizer_actions(schedule)
    simulate_order(schedule)


def check_message_order(schedule: Sequence[Sequence[Action]]) -> None:
    """Each stage receives a neighbour's messages of one kind in the order the neighbour sends them.

    Gloo matches a receive to its send by tag, so any order works there; NCCL matches them by order
    on a communicator (one per boundary and direction here), so a receive posted out of order would be
    handed another microbatch's tensor without a word. Checks a lowered, validated schedule; raises
    ScheduleError with the grid, both the send and the receive marked.
    """
    num_stages = len(schedule)
    chunks = num_chunks(schedule)
    sent: dict[tuple[int, int, Kind], list[tuple[Action, int]]] = {}  # (src, dst, kind) -> (its RECV, step)
    received: dict[tuple[int, int, Kind], list[tuple[Action, int]]] = {}
    for stage, actions in enumerate(schedule):
        for index, action in enumerate(actions):
            if action.kind in (Kind.SEND_F, Kind.SEND_B):
                other, match = peer(stage, action, num_stages, chunks=chunks)
                sent.setdefault((stage, other, action.kind), []).append((match, index))
            elif action.kind in (Kind.RECV_F, Kind.RECV_B):
                other, match = peer(stage, action, num_stages, chunks=chunks)
                received.setdefault((other, stage, match.kind), []).append((action, index))
    for (src, dst, kind), sends in sent.items():
        for (want, send_at), (got, recv_at) in zip(sends, received.get((src, dst, kind), [])):
            if want != got:
                raise _error(schedule, f"stage {dst} step {recv_at}: {got} receives out of order: stage {src} sends "
                             f"{schedule[src][send_at]} (step {send_at}) first, and NCCL matches messages by order "
                             f"(receive in the order sent, or use backend = 'gloo')", {dst: recv_at, src: send_at})


# --------------------------------------------------------------------------- schedule files


def load_schedule_file(path: str | Path, num_stages: int, num_microbatches: int) -> Schedule:
    """Read a user-written schedule, lower it if it is compute-only, and validate it.

    Two formats; ``#`` starts a comment and blank lines are skipped in both:

    - text: one line per stage, its actions separated by spaces (``F0 F1 B0 F2 B1 B2``);
    - CSV (a ``.csv`` file, or one whose first line starts with ``stage``): a header
      ``stage 0,stage 1,...`` and then one row per step, one column per stage; a stage with fewer
      actions leaves its trailing cells empty (the layout ``format_grid`` prints).

    Actions may be compute-only (``F``/``B``/``W``; communication is then added by ``lower``) or
    already lowered. Every error is a ScheduleError that starts ``FILE: line N:``.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ScheduleError(f"{path}: cannot read schedule file: {error.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise ScheduleError(f"{path}: line {line} is not UTF-8 text (a schedule file is text: action strings "
                            "such as F0 B0, one line or CSV column per stage)") from None
    lines = [(number, raw.split("#", 1)[0].strip()) for number, raw in enumerate(text.splitlines(), 1)]
    lines = [(number, content) for number, content in lines if content]
    if not lines:
        raise ScheduleError(f"{path}: no actions (expected one line per stage, {num_stages} stages)")
    is_csv = path.suffix.lower() == ".csv" or lines[0][1].lower().startswith("stage")
    reader = _read_csv_schedule if is_csv else _read_text_schedule
    schedule, where = reader(path, lines, num_stages)

    def located(error: ScheduleError, note: str = "") -> ScheduleError:
        first, _, rest = str(error).partition("\n")
        stage, step = _locate(first)
        line = where(stage, step) if stage is not None else None
        prefix = f"{path}: line {line}: " if line is not None else f"{path}: "
        return ScheduleError(prefix + note + first + ("\n" + rest if rest else ""))

    try:
        validate(schedule, num_microbatches)
    except ScheduleError as error:
        raise located(error) from None
    if _is_lowered(schedule):
        return schedule
    lowered = lower(schedule)
    try:
        validate(lowered, num_microbatches)
    except ScheduleError as error:  # not expected: lowering keeps a valid order valid
        raise ScheduleError(f"{path}: after lowering: {error}") from None
    return lowered


# Where a validator message points: "stage S ..." and, when it names one, the step.
_STAGE_RE = re.compile(r"^(?:deadlock: )?stage (\d+)")
_STEP_RES = (
    re.compile(r"^stage \d+ step (\d+)"),
    re.compile(r"^deadlock: stage \d+ waits at \S+ \(step (\d+)\)"),
    re.compile(r"^stage \d+ runs \S+ twice \(steps \d+ and (\d+)\)"),
)


def _locate(message: str) -> tuple[int | None, int | None]:
    stage = _STAGE_RE.match(message)
    if stage is None:
        return None, None
    for pattern in _STEP_RES:
        step = pattern.match(message)
        if step:
            return int(stage[1]), int(step[1])
    return int(stage[1]), None


def _parse_cell(path: Path, line: int, token: str, what: str) -> Action:
    try:
        return Action.parse(token)
    except ScheduleError as error:
        raise ScheduleError(f"{path}: line {line}: {what}: {error}") from None


def _read_text_schedule(path: Path, lines: list[tuple[int, str]], num_stages: int):
    if len(lines) != num_stages:
        extra = lines[num_stages][0] if len(lines) > num_stages else lines[-1][0]
        raise ScheduleError(
            f"{path}: line {extra}: {len(lines)} stage lines, expected {num_stages} "
            "(one line of space-separated actions per stage)"
        )
    schedule = [
        [
            _parse_cell(path, number, token, f"stage {stage} action {index}")
            for index, token in enumerate(content.split())
        ]
        for stage, (number, content) in enumerate(lines)
    ]

    def where(stage: int, step: int | None) -> int | None:
        return lines[stage][0] if 0 <= stage < len(lines) else None

    return schedule, where


def _read_csv_schedule(path: Path, lines: list[tuple[int, str]], num_stages: int):
    header_line, header = lines[0]
    names = [cell.strip() for cell in next(csv.reader(io.StringIO(header)))]
    expected = [f"stage {stage}" for stage in range(num_stages)]
    if names != expected:
        raise ScheduleError(
            f"{path}: line {header_line}: header {','.join(names)!r}, expected "
            f"{','.join(expected)!r} (one column per stage)"
        )
    schedule: Schedule = [[] for _ in range(num_stages)]
    rows: list[list[int]] = [[] for _ in range(num_stages)]  # file line of each stage's step
    for number, content in lines[1:]:
        cells = [cell.strip() for cell in next(csv.reader(io.StringIO(content)))]
        if len(cells) > num_stages:
            raise ScheduleError(
                f"{path}: line {number}: {len(cells)} cells, but the header has {num_stages} stages"
            )
        for stage, cell in enumerate(cells):
            if cell:
                schedule[stage].append(_parse_cell(path, number, cell, f"stage {stage}"))
                rows[stage].append(number)

    def where(stage: int, step: int | None) -> int | None:
        if not 0 <= stage < num_stages:
            return None
        if step is None or step >= len(rows[stage]):
            return header_line
        return rows[stage][step]

    return schedule, where
