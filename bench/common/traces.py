"""Traces of the benchmark runs (``hetero-launch --trace DIR``): per-step rows, compute intervals, bubbles.

Scripts import it as ``from bench.common import traces`` (see ``benchlib``, whose runs write the traces).
"""

from __future__ import annotations

from pathlib import Path


def _split_steps(row: list[tuple[str, float, float]]) -> list[list[tuple[str, float, float]]]:
    from hetero_llm.predict import trace as tracing

    return tracing.split_steps(row)


def trace_steps(directory: Path) -> list[list[list[tuple[str, float, float]]]]:
    """``[step][rank] -> (action, start s, end s)`` for the steps every rank recorded completely."""
    from hetero_llm.predict import trace as tracing

    _, rows = tracing.rank_rows(tracing.read_rank_traces(directory))
    per_rank = [_split_steps(row) for row in rows]
    steps = min(len(s) for s in per_rank)
    return [[per_rank[rank][k] for rank in range(len(rows))] for k in range(steps)]


def compute_intervals(
    step: list[list[tuple[str, float, float]]], chunks: int = 1
) -> list[list[tuple[str, float, float]]]:
    """Per rank (= stage: one pipeline, TP 1) the compute records (``F``, ``B``, ``I``, ``W``) with the wait
    for input cut off.

    The runtime records the wait for a received tensor as its own ``RECV`` record, so ``F``/``B``
    records are compute only; as a guard (older runtimes waited inside the ``F``), a compute start
    is never earlier than the end of the peer's matching ``SEND`` (one clock per host).
    """
    from hetero_llm.schedule import COMPUTE_KINDS, Action, Kind, peer, requirements

    num_stages = len(step)
    sends = [{a: e for a, _, e in row if a.startswith("SEND")} for row in step]
    out = []
    for stage, row in enumerate(step):
        kept = []
        for text, start, end in row:
            action = Action.parse(text)
            if action.kind not in COMPUTE_KINDS:
                continue
            for _, needed in requirements(stage, action, num_stages, lowered=True, chunks=chunks):
                if needed.kind in (Kind.RECV_F, Kind.RECV_B):
                    src, send = peer(stage, needed, num_stages, chunks=chunks)
                    posted = sends[src].get(str(send))
                    if posted is not None:
                        start = min(max(start, posted), end)
            kept.append((text, start, end))
        out.append(kept)
    return out


def step_span(step: list[list[tuple[str, float, float]]]) -> float:
    """Seconds from the first compute's start to the last compute's end, over every rank.

    Compute, not every record: a rank that finished the previous step's optimizer early posts its
    receives and waits before the first stage has started; that wait is not part of the pipeline.
    """
    rows = [[r for r in row if r[0][0] in "FBW"] for row in step]
    return max(e for row in rows for _, _, e in row) - min(s for row in rows for _, s, _ in row)


def bubble_fraction(step: list[list[tuple[str, float, float]]], chunks: int = 1) -> float:
    """Idle fraction of all stages together over the step's span (idle = not computing F or B)."""
    busy = sum(e - s for row in compute_intervals(step, chunks) for _, s, e in row)
    return 1.0 - busy / (len(step) * step_span(step))
