"""A Monte-Carlo model of pipeline scheduling policies (stages run in parallel; transfers take ``latency``).

``python -m bench.pipeline.dynamic_vs_1f1b`` feeds it the per-stage compute times it measured, to show what a policy
itself can gain when compute times are drawn like the runtime's emulation draws them (the library's simulator
runs fixed action lists only), next to a lower bound for any order and to variants the runtime does not have.
"""

from __future__ import annotations

import random

import attrs


@attrs.frozen
class Policy:
    """How a stage picks its next compute action.

    ``fixed``: run the 1F1B list in order, waiting for each input. Otherwise dynamic: among ready
    actions (a backward whose gradient arrived; the next forward if its input arrived and fewer than
    ``stages - stage + extra`` microbatches are in flight), take a backward first (``backward_first``)
    or the forward first. The runtime's ``run_dynamic`` is ``Policy("dynamic", backward_first=True)``.
    """

    name: str
    fixed: bool = False
    backward_first: bool = True
    extra: int = 0  # microbatches in flight beyond 1F1B's bound (more activation memory)


RUNTIME_POLICIES = (Policy("1f1b", fixed=True), Policy("dynamic"))


WHAT_IF_POLICIES = RUNTIME_POLICIES + (
    Policy("dynamic, forward first", backward_first=False),
    Policy("dynamic, +2 in flight", extra=2),
    Policy("dynamic, forward first, +2 in flight", backward_first=False, extra=2),
)


def model_policies(
    forward: list[float],
    backward: list[float],
    microbatches: int,
    multiplier,
    latency: float,
    steps: int = 200,
    seed: int = 0,
    policies=RUNTIME_POLICIES,
) -> dict[str, float]:
    """Mean step time of each policy when each compute's time is drawn, plus ``"bound"``.

    ``multiplier(stage, rng)`` scales one compute's time (the emulation: ``slowdown + U(0, jitter)``);
    every policy sees the same draws. ``bound`` is a lower bound for any order: the busiest stage's
    work plus the least fill (forwards of microbatch 0 before it) and drain (backwards of the last
    microbatch after it).
    """
    from hetero_llm.schedule import Kind, one_f_one_b

    S, M = len(forward), microbatches
    rng = random.Random(seed)
    fixed = [[("F" if a.kind is Kind.F else "B", a.mb) for a in actions] for actions in one_f_one_b(S, M)]
    totals = {p.name: 0.0 for p in policies} | {"bound": 0.0}
    for _ in range(steps):
        draw = {(s, k, m): multiplier(s, rng) for s in range(S) for k in "FB" for m in range(M)}

        def cost(s, k, m):
            return (forward if k == "F" else backward)[s] * draw[(s, k, m)]  # noqa: B023 (used in this iteration)

        totals["bound"] += max(
            sum(cost(s, k, m) for k in "FB" for m in range(M))
            + sum(cost(u, "F", 0) + latency for u in range(s))
            + sum(cost(u, "B", M - 1) + latency for u in range(s))
            for s in range(S)
        )
        for policy in policies:
            totals[policy.name] += _model_step(S, M, cost, latency, policy, fixed)
    return {k: v / steps for k, v in totals.items()}


def _model_step(S: int, M: int, cost, latency: float, policy: Policy, fixed) -> float:
    """One step, event by event: always commit the action (over all stages) that can start first."""
    f_ready = {(0, m): 0.0 for m in range(M)}  # (stage, mb) -> when the forward's input is there
    b_ready: dict[tuple[int, int], float] = {}
    free = [0.0] * S
    pending = [list(actions) for actions in fixed]
    in_flight: list[set[int]] = [set() for _ in range(S)]
    next_f, done, end = [0] * S, [0] * S, 0.0
    while any(d < M for d in done):
        best = None
        for s in range(S):
            if done[s] == M:
                continue
            if policy.fixed:
                k, m = pending[s][0]
                ready = (f_ready if k == "F" else b_ready).get((s, m))
                option = (max(free[s], ready), k, m) if ready is not None else None
            else:
                options = [(max(free[s], b_ready[(s, m)]), "B", m) for m in in_flight[s] if (s, m) in b_ready]
                f = next_f[s]
                if f < M and len(in_flight[s]) < S - s + policy.extra and (s, f) in f_ready:
                    options.append((max(free[s], f_ready[(s, f)]), "F", f))
                option = None
                if options:  # at the earliest moment something is ready, take the preferred kind
                    t0 = min(o[0] for o in options)
                    now = sorted(o for o in options if o[0] <= t0)
                    preferred = [o for o in now if (o[1] == "B") == policy.backward_first]
                    option = min(preferred or now, key=lambda o: o[2])
            if option is not None and (best is None or option[0] < best[0]):
                best = (option[0], s, option[1], option[2])
        t, s, k, m = best
        finish = t + cost(s, k, m)
        free[s], end = finish, max(end, finish)
        if (k, m) in pending[s]:
            pending[s].remove((k, m))
        if k == "F":
            in_flight[s].add(m)
            next_f[s] += 1
            if s + 1 < S:
                f_ready[(s + 1, m)] = finish + latency
            else:
                b_ready[(s, m)] = finish
        else:
            in_flight[s].discard(m)
            done[s] += 1
            if s > 0:
                b_ready[(s - 1, m)] = finish + latency
    return end
