"""bench/planner/plan_breakdown.py on a written trace: action durations per stage and kind, and message latencies split by
whether the receive was posted before or after the send (no processes: the trace files are written here)."""

from __future__ import annotations

import json

import pytest

from bench.planner import plan_breakdown, plan_vs_measured
from hetero_llm.planner.candidates import Candidate, PipelineChoice, StageChoice, TPGroup
from hetero_llm.planner.cluster import load_cluster
from hetero_llm.planner.cost import PlannerCostModel

# One GPipe step of two stages (f0:0 -> s0:0, across the domains), two microbatches: each rank's records as the
# runtime writes them (a RECV twice: posted, then waited for). F0's and B0's receives are posted before their
# sends (data there 0.19 s after the send); F1's and B1's after (there 0.3 s after the post).
STAGE0 = [
    ("F0", 0.0, 1.0),
    ("SEND_F0", 1.0, 1.01),
    ("F1", 1.01, 2.01),
    ("SEND_F1", 2.01, 2.02),
    ("RECV_B0", 2.02, 2.03),
    ("RECV_B0", 2.03, 5.7),
    ("B0", 5.7, 7.7),
    ("RECV_B1", 7.7, 7.71),
    ("RECV_B1", 7.71, 8.0),
    ("B1", 8.0, 10.0),
]
STAGE1 = [
    ("RECV_F0", 0.0, 0.01),
    ("RECV_F0", 0.01, 1.2),
    ("F0", 1.2, 2.2),
    ("RECV_F1", 2.2, 2.21),
    ("RECV_F1", 2.21, 2.5),
    ("F1", 2.5, 3.5),
    ("B0", 3.5, 5.5),
    ("SEND_B0", 5.5, 5.51),
    ("B1", 5.51, 7.51),
    ("SEND_B1", 7.51, 7.52),
]


def _write(folder, steps: int = 2, period: float = 20.0) -> None:
    folder.mkdir()
    for rank, (row, device) in enumerate(((STAGE0, "f0:0"), (STAGE1, "s0:0"))):
        events = [[a, s + k * period, e + k * period] for k in range(steps) for a, s, e in row]
        header = {"rank": rank, "pipeline": 0, "stage": rank, "device": device}
        (folder / f"rank{rank}.jsonl").write_text(json.dumps(header) + "\n" + json.dumps({"events": events}) + "\n")


def test_breakdown_of_a_written_trace(tmp_path):
    (tmp_path / "cluster.toml").write_text(plan_vs_measured.cluster_text(6, testbed=True))
    cluster = load_cluster(tmp_path / "cluster.toml")
    f0, s0 = cluster.node("f0"), cluster.node("s0")
    stages = (
        StageChoice(TPGroup("f0", f0.domain, ("f0:0",), f0.kind), 4),
        StageChoice(TPGroup("s0", s0.domain, ("s0:0",), s0.kind), 4),
    )
    cand = Candidate((PipelineChoice(8, 2, stages),), "gpipe")
    _write(tmp_path / "trace")

    messages = plan_breakdown.messages(cand, tmp_path / "trace", warmup=0)
    assert set(messages) == {"cross"}
    cross = messages["cross"]
    assert (cross["after_send_n"], cross["after_post_n"]) == (4, 4)  # two of each kind a step, two steps
    assert cross["after_send_s"] == pytest.approx(0.19)
    assert cross["after_post_s"] == pytest.approx(0.3)

    got = plan_breakdown.breakdown(PlannerCostModel(cluster), cand, tmp_path / "trace", [11.0, 10.5], warmup=1)
    first, second = got["stages"]
    assert (first["F_measured_s"], first["B_measured_s"]) == (pytest.approx(1.0), pytest.approx(2.0))
    assert second["F_measured_s"] == pytest.approx(1.0)
    assert first["send_per_action_s"] == pytest.approx(0.02 / 4)  # two sends of 10 ms over four compute actions
    assert first["recv_wait_per_step_s"] == pytest.approx(0.01 + 3.67 + 0.01 + 0.29)
    assert got["measured_step_s"] == 10.5 and got["measured_span_s"] == pytest.approx(10.0)
    assert got["measured_rest_s"] == pytest.approx(0.5)
    table = plan_breakdown.markdown([{"rank": 3, "breakdown": got}])
    assert "| 3 | cross | 190.00 (2) | 300.00 (2) |" in table  # the step after the warm-up one
