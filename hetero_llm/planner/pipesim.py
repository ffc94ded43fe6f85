"""A fast copy of ``simulate.simulate`` for compute-only schedules, for the planner's inner loop. Torch-free.

The planner scores thousands of pipelines; ``simulate.simulate`` validates the schedule and builds
attrs events on every call (about 3 s for 8 stages x 64 microbatches). This is the same semantics
(``schedule.requirements`` read for a compute-only schedule: each stage runs its actions in list order,
an action starts when its stage is free and its inputs have arrived, a transfer takes
``latency + bytes / bandwidth``, over a rendezvous link it starts a latency after the receive is posted at the
earliest) on plain tuples, for schedules the generators made (valid by
construction). tests/unit/test_planner.py checks it against ``simulate.simulate`` over a grid of
schedules and costs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hetero_llm import schedule as sched

F, B, I, W = 0, 1, 2, 3
_CODE = {sched.Kind.F: F, sched.Kind.B: B, sched.Kind.I: I, sched.Kind.W: W}


Acts = tuple[tuple[tuple[int, int, int], ...], ...]


@functools.lru_cache(maxsize=4096)
def actions(kind: str, stages: int, microbatches: int, chunks: int = 1) -> Acts:
    """The generator's compute-only schedule as (kind code, microbatch, chunk) tuples per stage: the same
    tuples as ``reference_actions`` (tests/unit/test_planner.py checks it over a grid), built without the
    validated ``schedule.Action`` objects (the planner asks for thousands of schedules of up to thousands of
    actions each). Arguments the generators refuse go to them, so the error is theirs."""
    ok = stages >= 1 and microbatches >= 1 and (chunks == 1 or kind == "interleaved")
    if not ok or kind not in ("gpipe", "1f1b", "zbh1", "interleaved"):
        return reference_actions(kind, stages, microbatches, chunks)
    if kind == "gpipe":
        one = tuple((F, mb, 0) for mb in range(microbatches)) + tuple((B, mb, 0) for mb in range(microbatches))
        return (one,) * stages
    if kind == "1f1b":
        return tuple(_one_f_one_b(min(stages - s - 1, microbatches), microbatches) for s in range(stages))
    if kind == "zbh1":
        return tuple(_zero_bubble_h1(s, stages, microbatches) for s in range(stages))
    if chunks < 1 or microbatches % stages:
        return reference_actions(kind, stages, microbatches, chunks)
    return tuple(_interleaved(s, stages, microbatches, chunks) for s in range(stages))


def reference_actions(kind: str, stages: int, microbatches: int, chunks: int = 1) -> Acts:
    """``actions`` from the schedule generators themselves (``schedule.compute_schedule``)."""
    lists = sched.compute_schedule(kind, stages, microbatches, chunks=chunks)
    return tuple(tuple((_CODE[a.kind], a.mb, a.chunk) for a in acts) for acts in lists)


def _one_f_one_b(warmup: int, m: int) -> tuple[tuple[int, int, int], ...]:
    out = [(F, mb, 0) for mb in range(warmup)]
    for step in range(m - warmup):
        out += [(F, warmup + step, 0), (B, step, 0)]
    out += [(B, mb, 0) for mb in range(m - warmup, m)]
    return tuple(out)


def _zero_bubble_h1(stage: int, stages: int, m: int) -> tuple[tuple[int, int, int], ...]:
    out: list[tuple[int, int, int]] = []
    weights = 0
    for code, mb, _ in _one_f_one_b(min(stages - stage - 1, m), m):
        if code == F:
            out.append((F, mb, 0))
            continue
        out.append((I, mb, 0))
        if mb >= stage:
            out.append((W, weights, 0))
            weights += 1
    out += [(W, mb, 0) for mb in range(weights, m)]
    return tuple(out)


def _interleaved(stage: int, stages: int, m: int, chunks: int) -> tuple[tuple[int, int, int], ...]:
    total, group = chunks * m, stages * chunks

    def forward(k: int) -> tuple[int, int, int]:
        return (F, (k // group) * stages + k % stages, (k % group) // stages)

    def backward(k: int) -> tuple[int, int, int]:
        return (B, (k // group) * stages + k % stages, chunks - 1 - (k % group) // stages)

    warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)
    out = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [forward(warmup + k), backward(k)]
    out += [backward(k) for k in range(total - warmup, total)]
    return tuple(out)


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


Held = tuple[tuple[float, float, float], ...]  # one stage's (full, put off, gradients) points, see held_in_flight


def held_in_flight(acts: Sequence[Sequence[tuple[int, int, int]]]) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Per stage, what it holds at once after any of its actions, as the largest ``(full, put_off, grads)`` points
    (none another's componentwise smaller): ``full`` the microbatches whose forward ran and whose backward (B or
    I) has not, ``put_off`` those whose I ran and whose W has not (a split backward holds its linear layers'
    inputs and output gradients until its W), ``grads`` 1 once a B or a W has made the step's weight gradients
    (the runtime frees them after each step). Inside an action a stage holds at most what it holds before or
    after it: a forward only adds; a backward frees its activations as it makes gradients."""
    out = []
    for stage in acts:
        full = put_off = grads = 0
        points = {(0, 0, 0)}
        for code, _, _ in stage:
            if code == F:
                full += 1
            elif code == B:
                full, grads = full - 1, 1
            elif code == I:
                full, put_off = full - 1, put_off + 1
            elif code == W:
                put_off, grads = put_off - 1, 1
            points.add((full, put_off, grads))
        out.append(_largest(points))
    return tuple(out)


def _largest(points: set[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...]:
    """The points no other point is at least as large as in every coordinate (the third is 0 or 1), sorted."""
    keep: list[tuple[int, int, int]] = []
    for grads in (1, 0):  # a point with gradients dominates one without that is no larger otherwise
        front: list[tuple[int, int, int]] = []
        top = -1
        for full, put_off, g in sorted((p for p in points if p[2] == grads), reverse=True):
            if put_off > top:  # larger put_off than every point of more (or as many) whole microbatches
                front.append((full, put_off, g))
                top = put_off
        keep += [p for p in front if not any(q[0] >= p[0] and q[1] >= p[1] for q in keep if q[2] > p[2])]
    return tuple(sorted(keep))


# C901: the search's innermost loop (every candidate's every action), kept in one function on purpose: a call
# per action would cost the search's time
def simulate(  # noqa: C901
    acts,
    forward: Sequence[float],
    backward: Sequence[float],
    weight: Sequence[float] | None,
    latency: Sequence[float],
    bandwidth: Sequence[float],
    nbytes: float,
    rendezvous: Sequence[bool] | None = None,
) -> tuple[float, tuple[float, ...]]:
    """(step seconds, busy seconds per stage), as ``simulate.simulate`` computes them (``rendezvous``: per link,
    as ``CostModel.rendezvous``: a message moves only once its receive is posted, when its stage is free)."""
    n = len(acts)
    chunks = 1 + max((c for stage in acts for _, _, c in stage), default=0)
    m = 1 + max((mb for stage in acts for _, mb, _ in stage), default=0)
    nv = n * chunks
    # hop[v]: seconds for data to go between virtual stages v and v + 1 (their stages' link; 0 on one stage)
    hop = []
    post = []  # with rendezvous: seconds from a receive's post until its data is there (a notice back, then the hop)
    for v in range(nv - 1):
        a, b = v % n, (v + 1) % n
        if a == b:
            hop.append(0.0)
            post.append(0.0)
        else:
            link = min(a, b) if abs(a - b) == 1 else n - 1
            hop.append(latency[link] + nbytes / bandwidth[link])
            post.append(latency[link] + hop[-1] if rendezvous is not None and rendezvous[link] else 0.0)
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
                        t = max(t + hop[v - 1], ready + post[v - 1])
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
                        t = max(t + hop[v], free[s] + post[v])  # posted when the stage was free
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
