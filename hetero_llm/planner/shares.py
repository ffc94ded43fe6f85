"""The batch split of the planner's search: how many microbatches each pipeline of a structure gets, so that the
slowest finishes first; exact, deterministic, torch-free (``search.Planner._realize`` calls it per structure)."""

from __future__ import annotations

import heapq
import math

INF = math.inf


def batch_shares(fill: list[float], slow: list[float], unit: list[int], total: int) -> list[int] | None:
    """Microbatches per pipeline: ``total`` microbatches, ``unit[i]`` at a time, each to the pipeline whose time
    ``fill + (m - 1) x slow`` (m: its microbatches) grows least, the lower index on a tie; None when they do not
    come out even. A heap keeps it O(M log P): its keys (time, index) are distinct, so the order of pops is a
    function of its contents; with unit 1 the microbatches below a level go at once (``below_level``) and the heap
    gives the rest (tests/unit/test_planner.py checks both against the plain loop)."""
    counts = [0] * len(fill)
    ones = bool(fill) and all(u == 1 for u in unit)
    if ones:  # the first microbatches at once: those whose keys are below a level that leaves some for the heap
        counts = below_level(fill, slow, total)
    heap = [(fill[i] + (counts[i] + unit[i] - 1) * slow[i], i) for i in range(len(counts))]
    heapq.heapify(heap)
    left = total - sum(counts)
    if ones:  # the loop below with unit 1 (never more than what is left), unrolled
        replace = heapq.heapreplace
        while left > 0:
            i = heap[0][1]
            m = counts[i] = counts[i] + 1
            left -= 1
            replace(heap, (fill[i] + m * slow[i], i))
    while left > 0 and heap:
        _, i = heapq.heappop(heap)
        if unit[i] > left:
            continue
        counts[i] += unit[i]
        left -= unit[i]
        heapq.heappush(heap, (fill[i] + (counts[i] + unit[i] - 1) * slow[i], i))
    return None if left else counts


def below_level(fill: list[float], slow: list[float], total: int) -> list[int]:
    """For ``batch_shares`` with unit 1: per pipeline, how many of its keys ``fill + m x slow`` (m = 0, 1, ...,
    as the heap computes them) are below a level T chosen so that at most ``total`` are. Every key below T comes
    before every other in the heap's order (keys grow with m), so the heap would give exactly these first; it then
    gives the rest (about two per pipeline) from there. All zeros where no level helps (few microbatches, a
    pipeline whose keys do not grow)."""
    P = len(fill)
    target = total - 2 * P  # the continuous level's count, less the rounding up of each pipeline's
    zeros = [0] * P
    if target <= 0 or not all(0.0 < x < INF for x in slow) or not all(0.0 <= x < INF for x in fill):
        return zeros
    # the level T where sum over pipelines of max(0, (T - fill) / slow) = target: piecewise linear in T
    rate, offset, level = 0.0, 0.0, 0.0
    order = sorted(range(P), key=lambda i: fill[i])
    for k, i in enumerate(order):
        rate += 1.0 / slow[i]
        offset += fill[i] / slow[i]
        level = (target + offset) / rate
        if k + 1 == P or level <= fill[order[k + 1]]:
            break
    counts = []
    for f, s in zip(fill, slow):
        m = max(0, math.ceil((level - f) / s))  # the first m whose key reaches the level, up to rounding
        while m > 0 and f + (m - 1) * s >= level:
            m -= 1
        while f + m * s < level:
            m += 1
        counts.append(m)
    return counts if sum(counts) <= total else zeros
