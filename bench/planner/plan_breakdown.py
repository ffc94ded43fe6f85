"""Where a plan's predicted step and its measured one part: a traced run broken down as the cost model prices it.

``bench/planner/plan_vs_measured.py --trace`` runs every plan with ``hetero-launch --trace`` and calls ``breakdown`` on
each run: per stage and action kind (``F``, ``B``, ``I``, ``W``) the measured median duration against the
emulated one (the cost model's, which ``HETERO_EMULATE_ACTION_S`` sets: a longer one is the real work inside
it overrunning, e.g. TP all-reduces over gloo), the rank's time between its records (the interpreter's own
time, posting sends and receives) per compute action, the time spent waiting for received tensors; per step
the span of the pipelines' compute against the model's pipeline time, and the rest of the step (gradient
sync, optimizer, the step's loss all-reduce) against the model's sync + optimizer. A **replay** simulates
each pipeline with the model's links but the measured action durations (``planner.pipesim``): the model's
pipeline time minus the replay is what its action durations miss, the replay minus the measured span what
its communication misses.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.common import traces
from hetero_llm.planner.candidates import Candidate
from hetero_llm.planner.cost import PlannerCostModel
from hetero_llm.predict import trace as tracing

KINDS = ("F", "B", "I", "W")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def stage_ranks(trace_dir: Path) -> dict[tuple[int, int], list[int]]:
    """(pipeline, stage) -> its ranks, from the trace files' headers."""
    out: dict[tuple[int, int], list[int]] = {}
    for record in tracing.read_rank_traces(trace_dir):
        out.setdefault((record["pipeline"], record["stage"]), []).append(record["rank"])
    return out


def emulated(cost: PlannerCostModel, cand: Candidate) -> dict[tuple[int, int], dict[str, float]]:
    """(pipeline, stage) -> each compute action kind's seconds as the cost model gives them (the device's compute
    and TP time; an interleaved stage's per chunk): what plan_vs_measured.emulation_env emulates."""
    out = {}
    for p, pipe in enumerate(cand.pipelines):
        for i, s in enumerate(pipe.stages):
            f, b, w, _ = cost.stage_times(s.group, s.layers, i == len(pipe.stages) - 1, pipe.rows, s.recompute)
            c = cand.chunks if cand.schedule == "interleaved" and len(pipe.stages) > 1 else 1
            out[(p, i)] = {"F": f / c, "B": b / c, "I": (b - w) / c, "W": w / c}
    return out


def _rank_step(row: list[tuple[str, float, float]]) -> dict:
    """One rank's records of one step: compute durations by kind, receive waits, sends, the time between records
    (ZeRO-1's ``RS`` and ``AG`` left out: they wait for the step's end and the next step's start; and what follows
    the last compute or send: a receive the next step posts before its ``AG``)."""
    row = [r for r in row if tracing.action_kind(r[0]) not in ("RS", "AG")]
    last = max((i for i, r in enumerate(row) if r[0][0] in "FBIW" or r[0].startswith("SEND")), default=-1)
    row = row[: last + 1]
    durations: dict[str, list[float]] = {k: [] for k in KINDS}
    recv = send = covered = 0.0
    for action, start, end in row:
        kind = tracing.action_kind(action)
        if kind in durations:
            durations[kind].append(end - start)
        elif kind.startswith("RECV"):
            recv += end - start
        elif kind.startswith("SEND"):
            send += end - start
        covered += end - start
    span = row[-1][2] - row[0][1] if row else 0.0
    compute = sum(len(v) for v in durations.values())
    return {"durations": durations, "recv": recv, "send": send, "between": span - covered, "actions": compute}


def breakdown(cost: PlannerCostModel, cand: Candidate, trace_dir: Path, step_s: list[float], warmup: int) -> dict:
    """The traced run of ``cand`` (``step_s``: rank 0's step seconds) against ``cost``'s prediction, over the
    steps after ``warmup``."""
    steps = traces.trace_steps(trace_dir)[warmup:]
    ranks = stage_ranks(trace_dir)
    target = emulated(cost, cand)
    overhead = cost.action_overhead
    stages = []
    per_rank = [[_rank_step(step[r]) for r in range(len(step))] for step in steps]
    measured_stage: dict[tuple[int, int], dict[str, float]] = {}
    for key in sorted(ranks):
        got = {k: [d for step in per_rank for r in ranks[key] for d in step[r]["durations"][k]] for k in KINDS}
        recs = [step[r] for step in per_rank for r in ranks[key]]
        actions = max(sum(x["actions"] for x in recs), 1)
        between = sum(x["between"] + x["send"] for x in recs) / actions
        measured_stage[key] = {k: _median(v) for k, v in got.items()}
        measured_stage[key]["between"] = between
        stages.append(
            {
                "stage": f"p{key[0]}.s{key[1]}",
                "ranks": ranks[key],
                "tp": len(ranks[key]),
                **{f"{k}_emulated_s": target[key][k] for k in KINDS if got[k]},
                **{f"{k}_measured_s": measured_stage[key][k] for k in KINDS if got[k]},
                "host_per_action_s": between,
                "send_per_action_s": sum(x["send"] for x in recs) / actions,
                "model_per_action_s": overhead,
                "recv_wait_per_step_s": sum(x["recv"] for x in recs) / max(len(steps), 1) / len(ranks[key]),
            }
        )
    spans = [traces.step_span(step) for step in steps]
    predicted = cost.score(cand)
    replay = max(_replay(cost, cand, p, measured_stage) for p in range(len(cand.pipelines)))
    measured_step = _median(list(step_s[warmup:]))
    span = _median(spans)
    return {
        "stages": stages,
        "messages": messages(cand, trace_dir, warmup),
        "predicted_pipeline_s": max(predicted.pipeline_times),
        "replay_pipeline_s": replay,
        "measured_span_s": span,
        "predicted_rest_s": predicted.sync_time + predicted.optimizer_time,
        "measured_rest_s": measured_step - span,
        "predicted_step_s": predicted.step_time,
        "measured_step_s": measured_step,
    }


def _replay(
    cost: PlannerCostModel, cand: Candidate, p: int, measured: dict[tuple[int, int], dict[str, float]]
) -> float:
    """Pipeline ``p``'s step simulated with the model's links and the measured action durations (+ the
    measured time between records per action)."""
    pipe = cand.pipelines[p]
    st = pipe.stages
    c = cand.chunks if cand.schedule == "interleaved" and len(st) > 1 else 1
    zb = cand.schedule == "zbh1"
    fwd, bwd, wgt = [], [], []
    for i in range(len(st)):
        m = measured[(p, i)]
        h = m["between"]
        fwd.append(c * (m["F"] + h))
        if zb:
            bwd.append(c * (m["I"] + m["W"] + 2 * h))
            wgt.append(c * (m["W"] + h))
        else:
            bwd.append(c * (m["B"] + h))
            wgt.append(0.0)
    lat, bw, meet = cost.links(pipe, cand.schedule)
    nbytes = pipe.rows * cost.S * cost.H * cost.act_bytes
    step, _ = cost._simulate(
        cand.schedule, cand.chunks, pipe.microbatches, tuple(fwd), tuple(bwd), tuple(wgt), lat, bw, nbytes, meet
    )
    return step


def markdown(rows: list[dict]) -> str:
    """Three tables: per plan the step's parts (model, replay, measured), per stage the action kinds, per plan and
    path the messages' latencies."""
    lines = [
        "| # | pipeline s: model / replay / measured | rest s: model / measured | step s: model / measured |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        b = r["breakdown"]
        lines.append(
            f"| {r['rank']} | {b['predicted_pipeline_s']:.4f} / {b['replay_pipeline_s']:.4f} / "
            f"{b['measured_span_s']:.4f} | {b['predicted_rest_s']:.4f} / {b['measured_rest_s']:.4f} | "
            f"{b['predicted_step_s']:.4f} / {b['measured_step_s']:.4f} |"
        )
    lines += [
        "",
        "| # | stage | TP | F ms emulated / measured | B or I ms | W ms | host ms per action (model) | of which sends "
        "| recv wait ms per step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def pair(s: dict, k: str) -> str:
        if f"{k}_measured_s" not in s:
            return "-"
        return f"{s[f'{k}_emulated_s'] * 1e3:.1f} / {s[f'{k}_measured_s'] * 1e3:.1f}"

    for r in rows:
        for s in r["breakdown"]["stages"]:
            back = pair(s, "B") if "B_measured_s" in s else pair(s, "I")
            lines.append(
                f"| {r['rank']} | {s['stage']} | {s['tp']} | {pair(s, 'F')} | {back} | {pair(s, 'W')} | "
                f"{s['host_per_action_s'] * 1e3:.2f} ({s['model_per_action_s'] * 1e3:.2f}) | "
                f"{s['send_per_action_s'] * 1e3:.2f} | "
                f"{s['recv_wait_per_step_s'] * 1e3:.1f} |"
            )
    lines += [
        "",
        "| # | path | ms from send to arrival (receive posted first; n) | ms from post to arrival (posted after the send; n) |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        for path, m in r["breakdown"]["messages"].items():
            lines.append(
                f"| {r['rank']} | {path} | {m['after_send_s'] * 1e3:.2f} ({m['after_send_n']}) | "
                f"{m['after_post_s'] * 1e3:.2f} ({m['after_post_n']}) |"
            )
    return "\n".join(lines) + "\n"


def messages(cand: Candidate, trace_dir: Path, warmup: int) -> dict[str, dict[str, float]]:
    """Stage-boundary messages by path (``node``, ``domain``, ``cross``): how long after its send a message
    arrived when its receive was posted first (``after_send_s``), and how long after the receive was posted when
    it was posted after the send (``after_post_s``: gloo moves a message only once the receiver's ready
    notification reached the sender, so that is a round trip), medians over the steps after ``warmup``."""
    from hetero_llm.schedule import Action, peer

    records = tracing.read_rank_traces(trace_dir)
    where = {r["rank"]: (r["pipeline"], r["stage"]) for r in records}
    ranks = stage_ranks(trace_dir)
    steps = traces.trace_steps(trace_dir)[warmup:]
    early: dict[str, list[float]] = {}
    late: dict[str, list[float]] = {}
    for step in steps:
        sends: dict[tuple[int, str], float] = {}
        for rank, row in enumerate(step):
            for a, _, e in row:
                if a.startswith("SEND"):
                    sends[(rank, a)] = e
        for rank, row in enumerate(step):
            p, i = where[rank]
            pipe = cand.pipelines[p]
            n = len(pipe.stages)
            c = cand.chunks if cand.schedule == "interleaved" and n > 1 else 1
            posted: dict[str, float] = {}
            for a, s, e in row:
                if not a.startswith("RECV"):
                    continue
                if a not in posted:
                    posted[a] = s
                    continue
                other, match = peer(i, Action.parse(a), n, chunks=c)
                sent = [sends.get((r, str(match))) for r in ranks.get((p, other), [])]
                if not sent or None in sent:
                    continue
                send_end, post = max(sent), posted[a]
                here, there = pipe.stages[i].group, pipe.stages[other].group
                path = "node" if here.node == there.node else "domain" if here.domain == there.domain else "cross"
                if post < send_end:
                    early.setdefault(path, []).append(e - send_end)
                else:
                    late.setdefault(path, []).append(e - post)
    out = {}
    for path in sorted(set(early) | set(late)):
        out[path] = {
            "after_send_s": _median(early.get(path, [])),
            "after_send_n": len(early.get(path, [])),
            "after_post_s": _median(late.get(path, [])),
            "after_post_n": len(late.get(path, [])),
        }
    return out
