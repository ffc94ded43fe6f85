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


def simulate(
    acts,
    forward: Sequence[float],
    backward: Sequence[float],
    weight: Sequence[float] | None,
    latency: Sequence[float],
    bandwidth: Sequence[float],
    nbytes: float,
) -> tuple[float, tuple[float, ...]]:
    """(step seconds, busy seconds per stage), as ``simulate.simulate`` computes them."""
    n = len(acts)
    chunks = 1 + max((c for stage in acts for _, _, c in stage), default=0)
    m = 1 + max((mb for stage in acts for _, mb, _ in stage), default=0)
    nv = n * chunks
    # hop[v]: seconds for data to go between virtual stages v and v + 1 (their stages' link; 0 on one stage)
    hop = []
    for v in range(nv - 1):
        a, b = v % n, (v + 1) % n
        if a == b:
            hop.append(0.0)
        else:
            link = min(a, b) if abs(a - b) == 1 else n - 1
            hop.append(latency[link] + nbytes / bandwidth[link])
    dur = []
    for s in range(n):
        w = weight[s] if weight is not None else 0.0
        dur.append((forward[s] / chunks, backward[s] / chunks, (backward[s] - w) / chunks, w / chunks))
    end_f = [[-1.0] * m for _ in range(nv)]  # per virtual stage and microbatch; -1: not yet
    end_i = [[-1.0] * m for _ in range(nv)]  # the input gradient (from an I or a B)
    free = [0.0] * n
    busy = [0.0] * n
    pos = [0] * n
    remaining = sum(len(a) for a in acts)
    while remaining:
        progressed = False
        for s in range(n):
            stage, d = acts[s], dur[s]
            p = pos[s]
            while p < len(stage):
                code, mb, c = stage[p]
                v = c * n + s
                ready = free[s]
                if code == F:
                    if v:
                        t = end_f[v - 1][mb]
                        if t < 0:
                            break
                        t += hop[v - 1]
                        if t > ready:
                            ready = t
                elif code == W:
                    t = end_i[v][mb]
                    if t < 0:
                        break
                    if t > ready:
                        ready = t
                else:
                    t = end_f[v][mb]
                    if t < 0:
                        break
                    if t > ready:
                        ready = t
                    if v != nv - 1:
                        t = end_i[v + 1][mb]
                        if t < 0:
                            break
                        t += hop[v]
                        if t > ready:
                            ready = t
                end = ready + d[code]
                if code == F:
                    end_f[v][mb] = end
                elif code != W:
                    end_i[v][mb] = end
                busy[s] += end - ready
                free[s] = end
                p += 1
                remaining -= 1
                progressed = True
            pos[s] = p
        if not progressed:
            raise RuntimeError("schedule deadlocks (the generators never make one)")
    return max(free), tuple(busy)
