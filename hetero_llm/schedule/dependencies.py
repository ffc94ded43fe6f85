"""What each action waits for and what it makes true: the one statement of the schedule semantics.

The validator, the lockstep simulation and the cost-model simulator (``simulate``) read dependencies
from here and nowhere else.
"""

from __future__ import annotations

from hetero_llm.schedule.ir import BACKWARD_KINDS, OPTIMIZER_KINDS, Action, Event, Kind, first_virtual, last_virtual

# For each communication kind: the virtual-stage offset of its peer and the kind the peer runs.
_PEER = {
    Kind.SEND_F: (+1, Kind.RECV_F),
    Kind.RECV_F: (-1, Kind.SEND_F),
    Kind.SEND_B: (-1, Kind.RECV_B),
    Kind.RECV_B: (+1, Kind.SEND_B),
}


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
    first = first_virtual(stage, action.chunk)
    last = last_virtual(stage, action.chunk, num_stages, chunks)
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


def peer(stage: int, action: Action, num_stages: int | None = None, *, chunks: int = 1) -> Event:
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
