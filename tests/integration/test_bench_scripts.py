"""The benchmark scripts of bench/ run end to end (``--quick``) and write the results they promise (the
hot-switching benchmark: test_bench_hot_switch.py; the planner's: test_bench_planner_scripts.py).

Each script runs once as a real subprocess, as a user would start it, into a temporary folder;
the tests check the results files' tables and JSON fields, never the timings (the machine is
small and shared). The helpers the scripts share are checked on recorded rows, without processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_bench import _check_files, _headers, _run

from bench.common import benchlib, traces

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
def test_vs_torch_pipelining_quick(tmp_path):
    proc = _run("pipeline.vs_torch_pipelining", tmp_path)
    assert "rep 1/1" in proc.stdout  # progress lines while it runs
    payload = _check_files(
        tmp_path,
        "vs_torch_pipelining",
        [
            "stages",
            "schedule",
            "ours tokens/s",
            "torch tokens/s",
            "ratio ours/torch",
            "ratio range",
            "ratio (fastest steps)",
            "pairs",
            "max rel. loss diff",
        ],
        [
            "stages",
            "schedule",
            "ours_tokens_s",
            "torch_tokens_s",
            "ratio",
            "max_rel_loss_diff",
            "ours_step_ms",
            "torch_step_ms",
            "ours_compute_ms",
            "torch_compute_ms",
        ],
    )
    assert payload["paired"] and payload["separate"]  # both measurements ran
    assert {"ours_cpu_step_s", "torch_cpu_step_s"} <= set(payload["paired"][0])
    # same model, same data, same optimizer: both sides must log the same losses (float32 rounding)
    assert all(row["max_rel_loss_diff"] < 1e-4 for row in payload["paired"] + payload["separate"])


@pytest.mark.multiprocess
def test_dynamic_vs_1f1b_quick(tmp_path):
    _run("pipeline.dynamic_vs_1f1b", tmp_path)
    payload = _check_files(
        tmp_path,
        "dynamic_vs_1f1b",
        [
            "scenario",
            "1f1b tokens/s",
            "dynamic tokens/s",
            "ratio dynamic/1f1b",
            "ratio range",
            "bubble 1f1b",
            "bubble dynamic",
            "compute ms 1f1b",
            "compute ms dynamic",
            "CPU s 1f1b",
            "CPU s dynamic",
            "model ratio",
        ],
        ["scenario", "1f1b_tokens_s", "dynamic_tokens_s", "ratio", "model_ratio", "timelines"],
        more_tables=(
            [
                "scenario",
                "1f1b tokens/s",
                "dynamic tokens/s",
                "ratio dynamic/1f1b",
                "ratio range",
                "rounds",
                "1f1b CPU s/step",
                "dynamic CPU s/step",
                "dynamic / 1f1b CPU",
            ],
        ),
    )
    for row in payload["results"]:
        for png in row["timelines"].values():
            assert (tmp_path / png).stat().st_size > 0
    assert {"ratio", "1f1b_cpu_step_s", "dynamic_cpu_step_s"} <= set(payload["paired"][0])


@pytest.mark.multiprocess
def test_shm_bench_quick(tmp_path):
    _run("comm.shm_bench", tmp_path)
    payload = _check_files(
        tmp_path,
        "shm_bench",
        ["size", "gloo us", "shm us", "gloo/shm", "range", "gloo MB/s", "shm MB/s"],
        ["bytes", "gloo_us", "shm_us", "ratio", "gloo_MBps", "shm_MBps"],
        more_tables=(
            ["waiter", "CPU ms per 100 ms waited", "one-way 4 B, us", "one-way 1 MiB, us"],
            [
                "model",
                "schedule",
                "shm tokens/s",
                "gloo tokens/s",
                "shm/gloo",
                "range",
                "CPU s/step shm",
                "CPU s/step gloo",
                "same losses",
            ],
        ),
    )
    assert [r["bytes"] for r in payload["results"]] == [4, 64 << 10, 1 << 20, 16 << 20]
    assert [w["waiter"] for w in payload["waiting"]] == [
        "gloo",
        "shm, spin 0 us",
        "shm, spin 50 us",
        "shm, spin 500 us",
    ]
    assert {(t["schedule"], t["same_losses"]) for t in payload["training"]} == {("1f1b", True), ("dynamic", True)}


def test_sim_vs_measured_quick(tmp_path):
    _run("pipeline.sim_vs_measured", tmp_path)
    payload = _check_files(
        tmp_path,
        "sim_vs_measured",
        [
            "layout",
            "schedule",
            "measured ms",
            "predicted ms",
            "error %",
            "bubble measured",
            "bubble predicted",
            "full step ms",
            "F ms per stage",
            "B ms per stage",
        ],
        ["layout", "schedule", "measured_ms", "predicted_ms", "error_pct", "measured_bubble", "predicted_bubble"],
    )
    assert payload["p2p"]["latency_s"] > 0 and payload["p2p"]["bandwidth_bytes_s"] > 0


@pytest.mark.multiprocess
def test_zero_bubble_quick(tmp_path):
    _run("pipeline.zero_bubble", tmp_path)
    payload = _check_files(
        tmp_path,
        "zero_bubble",
        [
            "stages",
            "1f1b tokens/s",
            "zbh1 tokens/s",
            "ratio zbh1/1f1b",
            "ratio range",
            "rounds",
            "separate runs ratio",
            "simulated ratio",
            "bubble 1f1b",
            "bubble zbh1",
            "bubble simulated 1f1b / zbh1",
            "CPU s/step 1f1b / zbh1",
            "(I + W) / B",
        ],
        ["stages", "1f1b_tokens_s", "zbh1_tokens_s", "ratio", "predicted_ratio", "times_ms"],
        more_tables=(["stages", "1f1b F ms", "1f1b B ms", "zbh1 F ms", "zbh1 I ms", "zbh1 W ms"],),
    )
    for row in payload["results"]:
        assert set(row["times_ms"]["zbh1"]) == {"F", "I", "W"} and set(row["times_ms"]["1f1b"]) == {"F", "B"}
        assert row["max_rel_loss_diff"] < 1e-4  # the same model trained both ways
        assert row["predicted_peak_in_flight_zbh1"] == [2, 2]  # ZB-H1 keeps S microbatches on every stage
    assert (tmp_path / "zero_bubble_s2_zbh1.png").stat().st_size > 0


@pytest.mark.multiprocess
def test_launch_time_quick(tmp_path):
    _run("launch.launch_time", tmp_path)
    md = (tmp_path / "launch_time.md").read_text()
    assert ["source tree", "wall s per launch", "median s"] in _headers(md)
    assert "load average" in md and "torch" in md


def test_control_plane_quick(tmp_path):
    _run("launch.control_plane", tmp_path)
    md = (tmp_path / "control_plane.md").read_text()
    assert [
        "ranks",
        "nodes",
        *(f"{p} CPU s" for p in ("load", "compile", "preflight", "rank setup", "dry-run", "dry-run --full")),
        "dry-run lines",
        "--full lines",
    ] in _headers(md)
    rows = json.loads((tmp_path / "control_plane.json").read_text())["rows"]
    assert [r["ranks"] for r in rows] == [8, 64]
    assert rows[1]["dry-run lines"] < 40 < rows[1]["dry-run --full lines"]  # the summary does not list the ranks


def test_snapshot_cost_quick(tmp_path):
    _run("elastic.snapshot_cost", tmp_path)
    md = (tmp_path / "snapshot_cost.md").read_text()
    assert ["mode", "wall s", "cost ms/step (wall)", "training thread held ms/save", "of which waiting ms"] in _headers(
        md
    )
    rows = json.loads((tmp_path / "snapshot_cost.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["none", "disk, synchronous", "/dev/shm, synchronous", "/dev/shm, overlapped"]
    assert all(r["wall_s"] > 0 for r in rows) and rows[0]["ms_per_step"] == rows[0]["held_ms"] == 0
    assert all(r["held_ms"] > 0 for r in rows[1:])  # every save or snapshot was timed


def test_snapshot_restart_quick(tmp_path):
    before = set(Path("/dev/shm").glob("bench_snapshot_restart_*"))
    _run("elastic.snapshot_restart", tmp_path)
    md = (tmp_path / "snapshot_restart.md").read_text()
    headers = ["round resumes from", "agreement ms (slowest worker)", "the copy alone ms", "its check alone ms"]
    headers.append("MB copied")
    assert headers in _headers(md) and "load average" in md
    [row] = json.loads((tmp_path / "snapshot_restart.json").read_text())["rows"]
    assert row["memory_s"] > 0 and row["disk_s"] > 0 and row["copy_s"] > 0 and row["check_s"] > 0
    assert 1.0 < row["copied_mb"] < 2.0  # one replica of the reference model's state (1.3 MB), not two
    assert set(Path("/dev/shm").glob("bench_snapshot_restart_*")) == before  # its node memory removed


# ------------------------------------------------------------------------------------------ helpers


def test_trace_steps_split_where_the_first_compute_recurs():
    """A receive is recorded twice (posted, waited for); steps still split at the first compute action."""
    one = [
        ("RECV_F0", 0, 1),
        ("RECV_F0", 1, 2),
        ("F0", 2, 3),
        ("RECV_B0", 3, 3),
        ("RECV_B0", 3, 4),
        ("B0", 4, 5),
        ("SEND_B0", 5, 5),
    ]
    row = one + [(a, s + 10, e + 10) for a, s, e in one]
    steps = traces._split_steps(row)
    assert [[a for a, _, _ in step] for step in steps] == [[a for a, _, _ in one]] * 2
    assert steps[1][0][1] == 10


def test_compute_intervals_and_bubble():
    # stage 0: F0 [0, 1], B0 [3, 5]; stage 1 receives at 1, F0 [1, 2], B0 [2, 3]
    step = [
        [("F0", 0.0, 1.0), ("SEND_F0", 1.0, 1.0), ("RECV_B0", 1.0, 3.0), ("B0", 3.0, 5.0)],
        [("RECV_F0", 0.0, 0.0), ("RECV_F0", 0.0, 1.0), ("F0", 1.0, 2.0), ("B0", 2.0, 3.0), ("SEND_B0", 3.0, 3.0)],
    ]
    assert traces.compute_intervals(step) == [
        [("F0", 0.0, 1.0), ("B0", 3.0, 5.0)],
        [("F0", 1.0, 2.0), ("B0", 2.0, 3.0)],
    ]
    assert traces.step_span(step) == 5.0
    assert traces.bubble_fraction(step) == pytest.approx(1 - 5.0 / 10.0)


def test_markdown_table():
    assert benchlib.markdown_table(["a", "bb"], [[1, "x"]]) == "| a | bb |\n| - | -- |\n| 1 | x  |"


@pytest.mark.multiprocess
def test_soak_quick(tmp_path):
    _run("memory.soak", tmp_path)
    md = (tmp_path / "soak.md").read_text()
    assert ["rank", "RSS at step 100 MiB", "at step 400 MiB", "growth", "bytes per step", "target < 1%"] in _headers(md)
    result = json.loads((tmp_path / "soak.json").read_text())
    assert sorted(result["rss_kib"]) == sorted(str(s) for s in range(100, 401, 100))
    assert all(
        sorted(row) == ["0", "1"] and all(v > 10_000 for v in row.values()) for row in result["rss_kib"].values()
    )
    assert sorted(result["growth"]) == ["0", "1"]


@pytest.mark.multiprocess
def test_zero1_memory_quick(tmp_path):
    _run("memory.zero1_memory", tmp_path)
    payload = _check_files(
        tmp_path,
        "zero1_memory",
        [
            "layout",
            "rank",
            "state adamw MiB",
            "state zero1 MiB",
            "formula MiB",
            "factor",
            "peak RSS adamw MiB",
            "peak RSS zero1 MiB",
            "added adamw MiB",
            "added zero1 MiB",
            "saved MiB",
            "end RSS adamw MiB",
            "end RSS zero1 MiB",
        ],
        [
            "layout",
            "rank",
            "adamw_state_mib",
            "zero1_state_mib",
            "zero1_formula_mib",
            "state_factor",
            "adamw_peak_mib",
            "zero1_peak_mib",
        ],
    )
    for row in payload["results"]:  # the moments the ranks really kept are what the formula says
        assert row["zero1_state_mib"] == pytest.approx(row["zero1_formula_mib"], rel=1e-9)
    factors = {(r["layout"], r["rank"]): r["state_factor"] for r in payload["results"]}
    assert factors[("2 pipelines, tp 1 and tp 1", 0)] == pytest.approx(2.0, rel=1e-3)
    assert factors[("tp 2 beside tp 1", 2)] > 2.9  # the TP-1 rank keeps about a third of its state


def test_context_links_layouts_price_overlap(tmp_path):
    """bench.context.context_links' run layout (one emulated node a CP rank) and its one-node twin for --evaluate train the
    same stage; --evaluate prices cp 2 below cp 1, and cp_overlap = false above overlap over the slow link."""
    from bench.context import context_links
    from hetero_llm import layout

    cfg = context_links.config(True, 2.0, 178.0)
    cfg.update(link_gbps=0.7, latency_us=20.0)
    steps = {}
    for cp, overlap in ((1, True), (2, True), (2, False)):
        run, plan, cluster = context_links.texts(cfg, cp, overlap, [f"10.77.0.{i + 1}" for i in range(cp)])
        ran, planned = layout.loads(run), layout.loads(plan)
        assert [(s.cp, s.cp_overlap) for s in ran.pipelines[0].stages] == [(cp, overlap)]
        assert [n.host for n in ran.cluster.nodes] == [f"10.77.0.{i + 1}" for i in range(cp)]
        assert ran.model == planned.model and len(planned.cluster.nodes) == 1
        (tmp_path / "l.toml").write_text(plan)
        (tmp_path / "c.toml").write_text(cluster)
        steps[cp, overlap] = context_links.predicted(tmp_path / "c.toml", tmp_path / "l.toml")["step_time"]
    assert steps[2, True] < steps[2, False] < steps[1, True]


@pytest.mark.netns
def test_context_links_quick(tmp_path):
    """The shaped-link run (root only): cp 1 and cp 2 with overlap on and off, each step measured beside its
    prediction."""
    from bench import testbed

    ok, why = testbed.available()
    if not ok:
        pytest.skip(f"needs root and Linux network namespaces; runs on the CI machine and developer machines ({why})")
    _run("context.context_links", tmp_path)
    data = json.loads((tmp_path / "context_links_quick.json").read_text())
    assert [(r["cp"], r["overlap"]) for r in data["runs"]] == [(1, True), (2, True), (2, False)]
    assert all(len(r["step_s"]) == 3 and min(r["step_s"]) > 0 for r in data["runs"])
    assert data["path"]["bits_per_s"] > 0
    assert "| cp | overlap | predicted step s |" in (tmp_path / "context_links_quick.md").read_text()
