"""Lowering: add the communication (``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``) and ZeRO-1's
optimizer actions to a compute-only schedule; ``build`` is generator + lowering."""

from __future__ import annotations

from collections.abc import Sequence

from hetero_llm.errors import ScheduleError
from hetero_llm.schedule.generators import compute_schedule
from hetero_llm.schedule.ir import (
    BACKWARD_KINDS,
    COMM_KINDS,
    Action,
    ActionLists,
    Kind,
    first_virtual,
    last_virtual,
    num_chunks,
)


def lower(compute: Sequence[Sequence[Action]], chunks: int | None = None) -> ActionLists:
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
                    f"lower: stage {stage} already has communication ({action}); lower takes a compute-only schedule",
                    stage,
                )
            if action.chunk >= chunks:
                raise ScheduleError(
                    f"lower: stage {stage}: {action} names chunk {action.chunk}, "
                    f"but there are {chunks} chunks (0..{chunks - 1})",
                    stage,
                )
            same = (action.mb, action.chunk)
            first = first_virtual(stage, action.chunk)
            last = last_virtual(stage, action.chunk, num_stages, chunks)
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


def add_optimizer_actions(schedule: Sequence[Sequence[Action]]) -> ActionLists:
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


def build(kind: str, num_stages: int, num_microbatches: int, *, chunks: int = 1) -> ActionLists:
    """The runnable schedule: ``lower(compute_schedule(kind, num_stages, num_microbatches))``."""
    return lower(compute_schedule(kind, num_stages, num_microbatches, chunks=chunks), chunks)
