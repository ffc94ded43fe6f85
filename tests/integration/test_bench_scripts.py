"""The benchmark scripts of bench/ run end to end (``--quick``) and write the results they promise.

Each script runs once as a real subprocess, as a user would start it, into a temporary folder;
the tests check the results files' tables and JSON fields, never the timings (the machine is
small and shared). The helpers the scripts share are checked on recorded rows, without processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import benchlib, traces
from bench import hot_switch_config as hot

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, out: Path) -> subprocess.CompletedProcess:
    """``python -m bench.SCRIPT --quick --out-dir OUT`` from the repository root, as a user starts it."""
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{script}", "--quick", "--out-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=benchlib.clean_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"{script} --quick failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def _headers(markdown: str) -> list[list[str]]:
    """Column names of every markdown table in ``markdown``, in order."""
    lines = markdown.splitlines()
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for prev, line in zip([""] + lines, lines)
        if line.startswith("| ") and not prev.startswith("|")
    ]


def _check_files(
    out: Path, name: str, columns: list[str], fields: list[str], more_tables: tuple[list[str], ...] = ()
) -> dict:
    md = (out / f"{name}.md").read_text()
    headers = _headers(md)
    for table in (columns, *more_tables):
        assert table in headers, f"no table with columns {table} in {name}.md (tables: {headers})"
    assert "load average" in md and "torch" in md  # the machine and the load are published with the table
    payload = json.loads((out / f"{name}.json").read_text())
    assert payload["results"], "no result rows"
    for row in payload["results"]:
        assert set(fields) <= set(row), f"missing {sorted(set(fields) - set(row))}"
    assert (out / f"{name}.png").stat().st_size > 0
    return payload


@pytest.mark.multiprocess
def test_vs_torch_pipelining_quick(tmp_path):
    proc = _run("vs_torch_pipelining", tmp_path)
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
    _run("dynamic_vs_1f1b", tmp_path)
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
    _run("shm_bench", tmp_path)
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
    _run("sim_vs_measured", tmp_path)
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
    _run("zero_bubble", tmp_path)
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
    _run("launch_time", tmp_path)
    md = (tmp_path / "launch_time.md").read_text()
    assert ["source tree", "wall s per launch", "median s"] in _headers(md)
    assert "load average" in md and "torch" in md


def test_control_plane_quick(tmp_path):
    _run("control_plane", tmp_path)
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
    _run("snapshot_cost", tmp_path)
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
    _run("snapshot_restart", tmp_path)
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
    _run("soak", tmp_path)
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
    _run("zero1_memory", tmp_path)
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


def test_hot_switch_quick(tmp_path):
    _run("hot_switch", tmp_path)
    payload = _check_files(
        tmp_path,
        "hot_switch",
        [
            "layout",
            "tokens/s",
            "x best static",
            "step s",
            "simulated step s",
            "planner step s",
            "switch % of step",
            "switch s",
            "predicted switch s",
            "predicted / measured",
            "modelled peak MB",
            "modelled MB per device",
            "measured tensor peak MB per device",
            "peak RSS MB",
        ],
        ["layout", "regime", "corpus", "tokens_s", "vs_best_static", "modelled_peak_mb", "peak_rss_mb"],
    )
    rows = payload["results"]
    static = [r for r in rows if not r["switching"]]
    # the planner's best static layouts, in its order, every one within the cap; the baseline is the best measured
    assert len(static) == hot.QUICK.static_candidates and [r["layout"][:9] for r in static] == [
        "static #1",
        "static #2",
    ]
    assert static[0]["planner_step_s"] <= static[1]["planner_step_s"]
    assert all(r["fits_cap"] for r in static) and max(r["vs_best_static"] for r in static) == 1.0
    hands = [r for r in rows if r["layout"].startswith("switching dp2")]
    assert len(hands) == 2  # against TP 2, and against the recomputing DP 2
    for hand in hands:
        assert 0 < hand["switch_fraction"] < 1 and hand["predicted_switch_s"] > 0 and hand["switch_s"] > 0
    assert all(r["predicted_step_s"] > 0 and r["modelled_peak_mb"] > 0 for r in rows)
    for r in rows:  # every rank's tensors metered at its peak; bucket copies only where switching
        for device in r["tensor_at_peak_mb"]:
            assert device["parameters"] > 0 and device["gradients"] > 0
            assert (device.get("bucket copies", 0) > 0) == r["switching"]
        assert any(device["activations"] > 0 for device in r["tensor_at_peak_mb"])
        assert all(x > 0 for x in r["tensor_peak_mb_per_device"])
    (scenario,) = payload["scenarios"]
    assert scenario["planner_buckets"][0].startswith("hot switching, PREDICTED")
    assert "tp_comm = 2 x 312e12 / (6 x 4096 x 25e9) = 1.016" in scenario["derivation"]


def test_hot_switch_times_count_a_local_only_switch_from_each_ranks_own_entry(tmp_path):
    """A switch with messages costs its ranks from the moment both are in; a rank whose part is local copies waits for
    nobody, so its own span is its switch time (the slowest rank's, as ``switch_seconds`` prices it), even when it
    entered first and the other rank's entry came in the middle of its copies."""
    from bench.hot_switch_runs import switch_times

    events = {  # rank -> (action, start, end): one step, the second switch local-only
        0: [("SWITCH>b0", 0.0, 5.0), ("F0", 5.0, 6.0), ("SWITCH>home", 10.0, 13.0)],
        1: [("SWITCH>b0", 2.0, 5.0), ("F0", 5.0, 6.0), ("SWITCH>home", 11.0, 12.0)],
    }
    for rank, rows in events.items():
        record = {"rank": rank, "events": [{"action": a, "start": s, "end": e} for a, s, e in rows]}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(record))
    exchanging, local = {0: {1}, 1: {0}}, {0: set(), 1: set()}
    rank0, own = switch_times(tmp_path, [exchanging, local])
    assert rank0 == [5.0 + 3.0]  # rank 0's time in its switches, waiting included
    assert own == [(5.0 - 2.0) + 3.0]  # from both in to rank 0 out; then rank 0's own 3 s, not 13 - 11
    assert switch_times(tmp_path)[1] == [(5.0 - 2.0) + (13.0 - 11.0)]  # every rank counted as exchanging


def test_hot_switch_regimes_keep_the_real_ratio_of_tp_traffic_to_compute():
    """Each regime's tp_comm is a real GPU's: a 4096-wide layer's two forward all-reduces of bf16 activations at TP 2
    over its link, against its forward matmuls at its peak; the bench's emulated device (hidden 64, float32) then
    charges the same ratio (``action_seconds`` with and without the TP link)."""
    import attrs

    from bench.hot_switch_regimes import REGIMES
    from hetero_llm.predict.device import EmulatedDevice, action_seconds

    for key, regime in REGIMES.items():
        h, positions = 4096, 1000
        allreduces = 2 * positions * h * 2 / (regime.link_gbytes * 1e9)  # ring at TP 2: each sends its bytes once
        matmuls = positions * 24 * h * h / 2 / (regime.tflops * 1e12)
        assert regime.tp_comm == pytest.approx(allreduces / matmuls, rel=1e-9)
        cfg = attrs.evolve(hot.Config(), regime=key)
        device = EmulatedDevice.parse(hot.device_spec(cfg))
        model = hot.common(cfg, ()).model
        with_link = action_seconds(model, "F", 1, 1, 512, 0, 2, False, device)
        without = action_seconds(model, "F", 1, 1, 512, 0, 2, False, attrs.evolve(device, tp_bandwidth=float("inf")))
        assert (with_link - without) / without == pytest.approx(regime.tp_comm, rel=1e-5)
    assert REGIMES["a100-nvlink"].tp_comm < 0.1 < 1 < REGIMES["a100-pcie"].tp_comm < REGIMES["a100-ib100"].tp_comm


def test_hot_switch_static_baselines_are_the_planners_best_distinct_layouts_within_the_cap(tmp_path):
    """The static candidates are the planner's ranking (its best first, one per structure), each fits the cap
    the planner was given, and each is a layout the loader accepts on the bench's cluster."""
    import attrs

    from bench import hot_switch_static as static
    from hetero_llm import layout as layout_mod
    from hetero_llm.planner import plan_cluster

    cfg = attrs.evolve(hot.Config(), regime="a100-ib100")
    memory, found = static.static_candidates(cfg, tmp_path)
    assert len(found) == 3 and len({x.name for x in found}) == 3
    assert [x.predicted_s for x in found] == sorted(x.predicted_s for x in found)
    best = min(plan_cluster(static.load(cfg, tmp_path, memory, o), top=1).score.step_time for o in static.OPTIMIZERS)
    assert found[0].predicted_s == pytest.approx(best)
    assert any("recompute" in x.name for x in found)  # DP 2 does not fit the cap without it
    for x in found:
        assert static.modelled_peak(cfg, tmp_path, memory, x.layout) <= memory * 1e9 * 0.9
        path = tmp_path / "x.toml"
        path.write_text(layout_mod.dumps(x.layout))
        assert layout_mod.load(path).pipelines == x.layout.pipelines
    # the hand-made switching layout, its bucket layouts' parameter copies counted: over the cap static layouts keep
    hand = hot.switch_layout(cfg, "top-up", (1, 1))
    assert static.modelled_peak(cfg, tmp_path, memory, hand) > memory * 1e9 * 0.9


def test_hot_switch_layouts_are_predicted_in_the_order_of_their_padding(tmp_path):
    """The bench's three switching layouts on its full-size config, simulated on the same device and links (the
    bench's own predictions use a link probed before each run, so they differ by that noise): elastic buckets
    run no empty microbatches, and top-up also fills the long rows' padding with short documents."""
    from hetero_llm import layout as layout_mod
    from hetero_llm.predict.device import EmulatedDevice
    from hetero_llm.switching import predict

    cfg = hot.Config()
    device = EmulatedDevice.parse(hot.device_spec(cfg))
    links = {"local": (0.0, 50e9), "node": (2e-4, 1.5e9), "domain": (2e-4, 1.5e9), "cross_domain": (2e-4, 1.5e9)}
    rows = hot.bucket_rows_needed(cfg)
    steps = {}
    for mode in ("top-up", "elastic", "fixed"):
        path = tmp_path / f"{mode}.toml"
        path.write_text(hot.layout_text(cfg, mode, rows))
        lay = layout_mod.load(path)
        steps[mode] = sum(
            predict.simulate_buckets(lay, s, device, links, copy_bandwidth=50e9, block_overhead=1e-5).total
            for s in range(cfg.warmup, cfg.steps)
        )
    assert rows[0] > 1 and rows[1] > 1  # fixed buckets pad to the most microbatches any step needs
    assert steps["top-up"] < 0.95 * steps["elastic"] < 0.95 * 0.95 * steps["fixed"]


def test_hot_switch_testbed_layouts_put_each_device_on_its_own_node_of_one_domain(tmp_path):
    """``--network testbed``: two one-device nodes of one domain whose fabric (and the cross-domain one) run at the
    TP link's rate; the switching layout's buckets use both nodes and the simulator sees the same switches as on one
    node (the bytes moved do not depend on where the devices are)."""
    import attrs

    from hetero_llm import layout as layout_mod
    from hetero_llm.plan import compile_plan
    from hetero_llm.switching.transfers import bucket_plans, step_switch

    bytes_moved = {}
    for network in ("testbed", "loopback"):
        cfg = attrs.evolve(hot.Config(), network=network, regime="a100-ib100")
        path = tmp_path / f"{network}.toml"
        path.write_text(hot.layout_text(cfg, "top-up", (1, 1)))
        lay = layout_mod.load(path)
        if network == "testbed":
            assert [(n.name, n.domain, len(n.devices)) for n in lay.cluster.nodes] == [
                ("node0", "d0", 1),
                ("node1", "d0", 1),
            ]
            (domain,) = lay.cluster.domains
            assert domain.bandwidth_gbps == lay.cluster.cross_domain.bandwidth_gbps == pytest.approx(cfg.tp_gbps, 1e-5)
            assert f"tp_gbps={cfg.tp_gbps:.6g}" in hot.device_spec(cfg)
            assert {d for b in lay.buckets for p in b.pipelines for s in p.stages for d in s.devices} == {
                "node0:0",
                "node1:0",
            }
        home = compile_plan(lay)
        b0, b1 = bucket_plans(lay)
        bytes_moved[network] = [
            sum(t.nbytes for t in step_switch(home, a, b, params=True, grads=g).transfers if t.src != t.dst)
            for a, b, g in ((home, b0, False), (b0, b1, True))
        ]
    assert bytes_moved["testbed"] == bytes_moved["loopback"] and min(bytes_moved["testbed"]) > 0


def test_bench_layouts_load_back_to_what_they_were_built_from(tmp_path):
    """Every layout and cluster file the benches write, built as schema objects, is one the loader accepts (it
    checks them as it checks a user's file) and reloads to those objects; the GPU bench's CUDA and NCCL layouts
    and the full-size configurations too, which no CPU test run writes."""
    import attrs

    from bench import (
        control_plane,
        gpu_bench_cases,
        holmes_bench,
        launch_time,
        plan_bench,
        plan_memory,
        plan_vs_measured,
        soak,
        zero1_memory,
    )
    from hetero_llm import layout
    from hetero_llm.planner.cluster import load_cluster

    def reloads(made: layout.Layout) -> None:
        path = tmp_path / "made.toml"
        layout.dump(made, path)
        assert layout.load(path) == attrs.evolve(made, file=str(path))

    reloads(launch_time.launch_layout("x.toml"))
    reloads(control_plane.scale_layout("x.toml", 64))
    reloads(soak.soak_layout("x.toml", 10_050))
    for _, pipelines in zero1_memory.LAYOUTS:
        for optimizer in zero1_memory.OPTIMIZERS:
            reloads(zero1_memory.optimizer_layout("x.toml", pipelines, 512, 4, 3, optimizer))
    sections = plan_memory.cluster_sections(512, 1376, 4, 128, 8, 2)
    for schedule, chunks in plan_memory.SCHEDULES:
        reloads(plan_memory.schedule_layout(sections, "x.toml", schedule, chunks, 4, 8))
    for cfg in (hot.Config(), hot.QUICK, attrs.evolve(hot.Config(), network="testbed")):
        for mode in ("static", "top-up", "elastic", "fixed"):
            reloads(hot.switch_layout(cfg, mode, (2, 3)))
        reloads(hot.recompute_layout(cfg))

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 16)
    texts = [
        benchlib.layout_toml(benchlib.ModelConfig(), [4, 4], 4, "interleaved", chunks=2),
        benchlib.layout_toml(benchlib.ModelConfig(), [8], 1, "zbh1"),
    ]
    case = gpu_bench_cases.Case(gpu_bench_cases.SIZES["124m"], 1024, 16)
    for devices, kw in (
        (["cuda:0"], {"backend": "nccl", "compile_mode": "blocks"}),
        (["cuda:0"] * 2, {"stages": 2, "microbatches": 4}),
        (["cuda:0"] * 2, {}),
    ):
        texts.append(gpu_bench_cases.layout_toml(case, devices=devices, steps=20, corpus=corpus, **kw))
    for text in texts:
        (tmp_path / "text.toml").write_text(text)
        layout.load(tmp_path / "text.toml")

    holmes = tmp_path / "holmes.toml"
    holmes.write_text(
        holmes_bench.cluster_file(
            hidden=512,
            layers=4,
            heads=8,
            seq_len=32,
            batch=4,
            steps=8,
            domain_gbps=1.0,
            domain_us=100.0,
            cross_gbps=0.1,
            cross_us=1000.0,
        )
    )
    _, _, holmes_sections = layout.read_cluster_file(holmes, "the test")
    naive = layout.load(holmes_bench.naive_layout(holmes, tmp_path / "naive.toml", 2))
    assert attrs.evolve(naive, pipelines=()) == layout.Layout(file=naive.file, pipelines=(), **holmes_sections)
    domain = {n.name: n.domain for n in naive.cluster.nodes}  # one pipeline per domain
    assert [{domain[d.split(":")[0]] for s in p.stages for d in s.devices} for p in naive.pipelines] == [
        {"ib"},
        {"roce"},
    ]
    for text in (
        plan_bench.large_cluster(1024, 0, 2500, 30.0),
        plan_bench._draw_small(901),
        layout.dumps_cluster(sections),
        plan_vs_measured.cluster_text(6, testbed=True, action_us=812.5, p2p_us=61.25),
    ):
        path = tmp_path / "cluster.toml"
        path.write_text(text)
        load_cluster(path)


def test_published_quick(tmp_path):
    """``bench.published --quick``: a table row per published number; the Megatron 1.7B row's FLOPs redone by hand
    from the paper's formula and its step time, which is ``hetero-plan --evaluate``'s for the committed files; and
    the cluster files and layouts it writes are the committed ones."""
    from click.testing import CliRunner

    from hetero_llm.cli.plan import main as plan_main

    files = tmp_path / "files"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.published", "--quick", "--budget", "1", "--out-dir", str(tmp_path)]
        + ["--files-dir", str(files)],
        capture_output=True,
        text=True,
        timeout=300,
        env=benchlib.clean_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"published --quick failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    md = (tmp_path / "published.md").read_text()
    for table in (
        ["row", "GPUs", "metric", "published", "predicted", "predicted/published", "within 15%"],
        ["cluster", "published layout", "its step s", "pick's step s", "pick/published", "planner's pick", "plan s"],
    ):
        assert table in _headers(md)
    payload = json.loads((tmp_path / "published.json").read_text())
    rows = {r["row"]: r for r in payload["results"]}
    assert set(rows) == {
        "megatron_1.7b",
        "h100_gpt_1.3b_eager",
        "h100_gpt_1.3b_compiled",
        "h100_gpt_124m_eager",
        "h100_gpt_124m_compiled",
        "holmes_nic_aware",
        "holmes_default",
    }
    for r in rows.values():  # each row in the printed table, with its ratio
        assert f"| {r['row']} " in md and f"| {r['ratio']:.2f} " in md
        assert r["ratio"] == pytest.approx(r["predicted"] / r["published"], rel=1e-12)

    r = rows["megatron_1.7b"]
    assert (r["gpus"], r["published"]) == (32, 137.0)
    B, s, l, h, V = 512, 2048, 24, 2304, 51200  # global batch, sequence, layers, hidden, vocabulary
    flops = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert r["published_flops_per_step"] == pytest.approx(flops, rel=1e-12)
    assert r["predicted"] == pytest.approx(flops / r["step_time_s"] / 32 / 1e12, rel=1e-12)
    cli = CliRunner().invoke(plan_main, [str(ROOT / r["cluster"]), "--evaluate", str(ROOT / r["layout"]), "--json"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.output)["step_time"] == pytest.approx(r["step_time_s"], rel=1e-12)

    written = sorted(p.relative_to(files) for p in files.rglob("*.toml"))
    # Megatron 1.7B's cluster and layout; each H100 row's eager and compiled clusters and its layout; Holmes' and
    # Megatron-LM's clusters and layouts on Holmes' nodes
    assert len(written) == 2 + 2 * 3 + 2 * 2
    for rel in written:
        assert (files / rel).read_text() == (ROOT / rel).read_text(), f"{rel}: rerun python -m bench.published"
    assert {p["cluster"] for p in payload["picks"]} == {rows[n]["cluster"] for n in rows}


@pytest.mark.multiprocess
def test_plan_meter_quick(tmp_path):
    """The planner's pick for small_cpu.toml trained with the tensor meter: every rank's measured peak within 10% of
    the memory model's bytes for its stage, and not above them (the model must not say a layout fits when the
    tensors it holds do not)."""
    _run("plan_meter", tmp_path)
    payload = json.loads((tmp_path / "plan_meter.json").read_text())
    assert len(payload["results"]) == 4  # one a rank
    for row in payload["results"]:
        assert 0.9 <= row["ratio"] <= 1.0, row
    assert "load average" in (tmp_path / "plan_meter.md").read_text()


def test_plan_split_gap_quick(tmp_path):
    """The gaps the sub-solvers leave: the plan's predicted step over a descent's, never below 1 (the descent keeps
    only shorter steps), with the splits and rows it found."""
    _run("plan_split_gap", tmp_path)
    payload = json.loads((tmp_path / "plan_split_gap.json").read_text())
    assert len(payload["results"]) == 4  # the two CPU clusters and two generated ones
    for row in payload["results"]:
        assert row["split_gap"] >= 1 and row["rows_gap"] >= 1
        assert [sum(p) for p in row["better_splits"]] == [sum(p) for p in row["planned_splits"]]
    assert "Layer split minimising the step" in (tmp_path / "plan_split_gap.md").read_text()


def test_context_speed_layouts_match_their_cluster_files(tmp_path):
    """bench.context_speed's cp 1 and cp 2 layouts load, and ``hetero-plan --evaluate`` prices them on its cluster
    file's emulated device: the same model and rows, cp 2's step about half cp 1's (every rank's work 1/cp)."""
    from bench import context_speed
    from hetero_llm import layout

    steps = {}
    for cp in (1, 2):
        lay, cluster = context_speed.texts(cp, 256, 3, 4, 2, gflops=1.0)
        assert [s.cp for s in layout.loads(lay).pipelines[0].stages] == [cp]
        (tmp_path / f"l{cp}.toml").write_text(lay)
        (tmp_path / f"c{cp}.toml").write_text(cluster)
        steps[cp] = context_speed.predicted(tmp_path / f"c{cp}.toml", tmp_path / f"l{cp}.toml")["step_time"]
    assert 0.45 < steps[2] / steps[1] < 0.55
