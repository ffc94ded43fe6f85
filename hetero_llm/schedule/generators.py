"""Schedule generators: pure functions from (stages, microbatches[, chunks]) to compute-only action lists.

Each returns one list per stage of ``F``/``B`` (or ``F``/``I``/``W``) actions, no communication:
``lowering.lower`` adds that.
"""

from __future__ import annotations

from collections.abc import Callable

from hetero_llm.schedule.ir import Action, ActionLists, Kind


def _check_counts(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"need num_stages >= 1 and num_microbatches >= 1, "
            f"got num_stages={num_stages}, num_microbatches={num_microbatches}"
        )


def gpipe(num_stages: int, num_microbatches: int) -> ActionLists:
    """GPipe: every stage runs all forwards, then all backwards, both in microbatch order.

    Simple, but holds the activations of all microbatches at once.
    """
    _check_counts(num_stages, num_microbatches)
    forwards = [Action(Kind.F, mb) for mb in range(num_microbatches)]
    backwards = [Action(Kind.B, mb) for mb in range(num_microbatches)]
    return [forwards + backwards for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> ActionLists:
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


def interleaved_1f1b(num_stages: int, num_microbatches: int, chunks: int) -> ActionLists:
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


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> ActionLists:
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


# interleaved_1f1b also takes chunks (compute_schedule calls it with them), hence ``...``
_GENERATORS: dict[str, Callable[..., ActionLists]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zbh1": zero_bubble_h1,
}


def compute_schedule(kind: str, num_stages: int, num_microbatches: int, *, chunks: int = 1) -> ActionLists:
    """Compute-only schedule of the named kind: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zbh1"``.

    ``chunks`` is the number of model chunks per stage; only ``"interleaved"`` takes more than 1.
    """
    try:
        generator = _GENERATORS[kind]
    except KeyError:
        raise ValueError(f"unknown schedule {kind!r} (known: {', '.join(sorted(_GENERATORS))})") from None
    if kind == "interleaved":
        return interleaved_1f1b(num_stages, num_microbatches, chunks)
    if chunks != 1:
        raise ValueError(f"schedule {kind!r} has one chunk per stage, got chunks={chunks}")
    return generator(num_stages, num_microbatches)
