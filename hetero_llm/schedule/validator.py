"""The validator: static checks of a schedule, then a lockstep run of all stages that finds deadlocks.

Every error is a ScheduleError: one line saying what is wrong, then the grid with the failing step(s)
marked ``<-- ERROR HERE``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from hetero_llm.errors import ScheduleError
from hetero_llm.schedule.dependencies import peer, produces, requirements
from hetero_llm.schedule.ir import COMM_KINDS, OPTIMIZER_KINDS, Action, Event, Kind, format_grid, is_lowered, num_chunks


def _error(
    schedule: Sequence[Sequence[Action]],
    what: str,
    mark: dict[int, int] | None = None,
    *,
    stage: int | None = None,
    step: int | None = None,
) -> ScheduleError:
    """A ScheduleError: one line saying what is wrong, then the grid with the failing step(s) marked; located
    at ``stage`` and ``step`` (the step the line names; None where it names none)."""
    return ScheduleError(f"{what}\n{format_grid(schedule, mark)}", stage, step)


def _step_error(schedule: Sequence[Sequence[Action]], stage: int, step: int, what: str) -> ScheduleError:
    """An error about one step of one stage: marked in the grid and located there."""
    return _error(schedule, what, {stage: step}, stage=stage, step=step)


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
    lowered = is_lowered(schedule)
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
            while next_index[stage] < len(actions) and ready(stage, actions[next_index[stage]], this_round):
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
    lowered = is_lowered(schedule)
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
                raise _step_error(
                    schedule, stage, index, f"stage {stage} runs {action} twice (steps {seen[action]} and {index})"
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
        stage, index = min(run.stuck.items())  # the stage the message names
        raise _error(schedule, _deadlock_message(schedule, run.stuck), run.stuck, stage=stage, step=index)
    return run.rounds


def _check_types(schedule: Sequence[Sequence[Action]]) -> None:
    if not schedule:
        raise ScheduleError("schedule has no stages")
    for stage, actions in enumerate(schedule):
        for index, action in enumerate(actions):
            if not isinstance(action, Action):
                raise ScheduleError(
                    f"stage {stage} step {index}: {action!r} is not an Action "
                    "(use Action.parse or parse_actions for strings)",
                    stage,
                    index,
                )


def _check_microbatches(schedule: Sequence[Sequence[Action]], num_microbatches: int) -> None:
    """Every microbatch index is in range; every stage runs, once per (mb, chunk), F and either B or
    both I and W."""
    for stage, actions in enumerate(schedule):
        for index, action in enumerate(actions):
            if action.mb >= num_microbatches:
                raise _step_error(
                    schedule,
                    stage,
                    index,
                    f"stage {stage} step {index}: {action} names microbatch {action.mb}, "
                    f"but there are {num_microbatches} (0..{num_microbatches - 1})",
                )
    chunks = num_chunks(schedule)
    rule = f"every stage runs F and B (or I and W) exactly once per microbatch 0..{num_microbatches - 1}"
    if chunks > 1:
        rule += f" and chunk 0..{chunks - 1}"
    # These name a stage and no step: a schedule file points at the stage (its line, or a CSV's header).
    for stage, actions in enumerate(schedule):
        position = {action: index for index, action in enumerate(actions)}
        for chunk in range(chunks):
            for mb in range(num_microbatches):
                f, b, i, w = (Action(kind, mb, chunk) for kind in (Kind.F, Kind.B, Kind.I, Kind.W))
                if f not in position:
                    raise _error(schedule, f"stage {stage} is missing {f} ({rule})", stage=stage)
                if b in position and (i in position or w in position):
                    other = i if i in position else w
                    raise _error(
                        schedule,
                        f"stage {stage} runs both {b} and {other} (a backward is one B, or an I and a W)",
                        {stage: position[other]},
                        stage=stage,
                    )
                if b not in position and i not in position:
                    missing = (
                        f"{b} (or {i} and {w})" if w in position or any(a.kind is Kind.I for a in actions) else str(b)
                    )
                    raise _error(schedule, f"stage {stage} is missing {missing} ({rule})", stage=stage)
                if i in position and w not in position:
                    raise _error(
                        schedule,
                        f"stage {stage} runs {i} but never {w} (an input gradient I needs its weight gradient W later)",
                        {stage: position[i]},
                        stage=stage,
                    )


def _check_dependencies(schedule: Sequence[Sequence[Action]]) -> None:
    """Own-stage requirements come earlier; cross-stage ones exist; every SEND has its RECV."""
    num_stages = len(schedule)
    lowered = is_lowered(schedule)
    chunks = num_chunks(schedule)
    positions = [{action: index for index, action in enumerate(actions)} for actions in schedule]
    made_at = [
        {made: index for index, action in enumerate(actions) for _, made in produces(stage, action)}
        for stage, actions in enumerate(schedule)
    ]
    for stage, actions in enumerate(schedule):
        for index, action in enumerate(actions):
            here = f"stage {stage} step {index}: {action}"
            if action.kind in COMM_KINDS:
                other, match = peer(stage, action, num_stages, chunks=chunks)
                if not 0 <= other < num_stages:
                    side = "previous" if other < stage else "next"
                    raise _step_error(
                        schedule, stage, index, f"{here} talks to stage {other}, but stage {stage} has no {side} stage"
                    )
                if match not in positions[other]:
                    raise _step_error(schedule, stage, index, f"{here} has no matching {match} on stage {other}")
            for other, needed in requirements(stage, action, num_stages, lowered=lowered, chunks=chunks):
                if other != stage:
                    continue  # cross-stage: checked above (comm) or by coverage (compute-only)
                where = made_at[stage].get(needed)
                if where is None:
                    raise _step_error(
                        schedule, stage, index, f"{here} needs {_named(needed)} first, which stage {stage} never does"
                    )
                if where > index:
                    raise _step_error(
                        schedule,
                        stage,
                        index,
                        f"{here} needs {_named(needed)} first, but {schedule[stage][where]} comes later (step {where})",
                    )


def _check_optimizer_actions(schedule: Sequence[Sequence[Action]]) -> None:
    """``AG0`` (if any) comes before every forward of its stage, ``RS0`` after every backward."""
    for stage, actions in enumerate(schedule):
        for index, action in enumerate(actions):
            if action.kind not in OPTIMIZER_KINDS:
                continue
            if action.mb or action.chunk:
                raise _step_error(
                    schedule,
                    stage,
                    index,
                    f"stage {stage} step {index}: {action}: "
                    f"{action.kind.value} is once per step, written {action.kind.value}0",
                )
            wrong = (Kind.F,) if action.kind is Kind.AG else (Kind.B, Kind.I, Kind.W)
            before = actions[:index] if action.kind is Kind.AG else actions[index + 1 :]
            clash = next((a for a in before if a.kind in wrong), None)
            if clash is not None:
                rule = "before the stage's first forward" if action.kind is Kind.AG else "after its last backward"
                raise _step_error(
                    schedule,
                    stage,
                    index,
                    f"stage {stage} step {index}: {action} must come {rule} ({clash} is on the wrong side)",
                )


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
                raise _error(
                    schedule,
                    f"stage {dst} step {recv_at}: {got} receives out of order: stage {src} sends "
                    f"{schedule[src][send_at]} (step {send_at}) first, and NCCL matches messages by order "
                    f"(receive in the order sent, or use backend = 'gloo')",
                    {dst: recv_at, src: send_at},
                    stage=dst,
                    step=recv_at,
                )
