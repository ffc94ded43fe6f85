"""A fast copy of ``simulate.simulate`` for compute-only schedules, for the planner's inner loop. Torch-free.

The planner scores thousands of pipelines; ``simulate.simulate`` validates the schedule and builds
attrs events on every call (about 3 s for 8 stages x 64 microbatches). This is the same semantics
(``schedule.requirements`` read for a compute-only schedule: each stage runs its actions in list order,
an action starts when its stage is free and its inputs have arrived, a transfer takes
``latency + bytes / bandwidth``) on plain tuples, for schedules the generators made (valid by
construction). tests/test_planner.py checks it against ``simulate.simulate`` over a grid of
schedules and costs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hetero_llm import schedule as sched

F, B, I, W = 0, 1, 2, 3
_CODE = {sched.Kind.F: F, sched.Kind.B: B, sched.Kind.I: I, sched.Kind.W: W}


@functools.lru_cache(maxsize=4096)
def actions(kind: str, stages: int, microbatches: int, chunks: int = 1) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """The generator's compute-only schedule as (kind code, microbatch, chunk) tuples per stage."""
    lists = sched.compute_schedule(kind, stages, microbatches, chunks=chunks)
    return tuple(tuple((_CODE[a.kind], a.mb, a.chunk) for a in acts) for acts in lists)


def peak_in_flight(acts: Sequence[Sequence[tuple[int, int, int]]]) -> tuple[int, ...]:
    """Per stage, the most microbatches whose forward ran and whose backward (B, or the W) has not."""
    out = []
    for stage in acts:
        live = peak = 0
        for code, _, _ in stage:
            if code == F:
                live += 1
                peak = max(peak, live)
            elif code in (B, W):
                live -= 1
        out.append(peak)
    return tuple(out)


def simulate(acts, forward: Sequence[float], backward: Sequence[float], weight: Sequence[float] | None,
             latency: Sequence[float], bandwidth: Sequence[float], nbytes: float) -> tuple[float, tuple[float, ...]]:
    """(step seconds, busy seconds per stage), as ``simulate.simulate`` computes them."""
    n = len(acts)
    chunks = 1 + max((c for stage in acts for _, _, c in stage), default=0)
    last_v = n * chunks - 1

    def transfer(src: int, dst: int) -> float:
        if src == dst:
            return 0.0
        link = min(src, dst) if abs(src - dst) == 1 else n - 1
        return latency[link] + nbytes / bandwidth[link]

    dur = []
    for s in range(n):
        w = weight[s] if weight is not None else 0.0
        dur.append((forward[s] / chunks, backward[s] / chunks, (backward[s] - w) / chunks, w / chunks))
    done: dict[tuple[int, int, int, int], float] = {}  # (code, stage, mb, chunk) -> end; B also ends I
    free = [0.0] * n
    busy = [0.0] * n
    pos = [0] * n
    remaining = sum(len(a) for a in acts)
    while remaining:
        progressed = False
        for s in range(n):
            stage = acts[s]
            while pos[s] < len(stage):
                code, mb, c = stage[pos[s]]
                v = c * n + s
                ready = free[s]
                if code == F:
                    if v:
                        c2, s2 = divmod(v - 1, n)
                        t = done.get((F, s2, mb, c2))
                        if t is None:
                            break
                        ready = max(ready, t + transfer(s2, s))
                elif code == W:
                    t = done.get((I, s, mb, c))
                    if t is None:
                        break
                    ready = max(ready, t)
                else:
                    t = done.get((F, s, mb, c))
                    if t is None:
                        break
                    ready = max(ready, t)
                    if v != last_v:
                        c2, s2 = divmod(v + 1, n)
                        t = done.get((I, s2, mb, c2))
                        if t is None:
                            break
                        ready = max(ready, t + transfer(s2, s))
                end = ready + dur[s][code]
                done[(code, s, mb, c)] = end
                if code == B:
                    done[(I, s, mb, c)] = end
                busy[s] += end - ready
                free[s] = end
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("schedule deadlocks (the generators never make one)")
    return max(free), tuple(busy)
