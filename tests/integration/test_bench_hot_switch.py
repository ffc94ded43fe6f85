"""The hot-switching benchmark (bench/hot_switch*.py): its --quick run, its switch times, regimes, static baselines,
predictions and testbed layouts; and bench/comm/switch_exchange.py (the switch exchange, old and new).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_bench import _check_files, _run

from bench.hot_switch import hot_switch_config as hot

ROOT = Path(__file__).resolve().parents[2]


def test_hot_switch_quick(tmp_path):
    _run("hot_switch.hot_switch", tmp_path)
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
    from bench.hot_switch.hot_switch_runs import switch_times

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

    from bench.hot_switch.hot_switch_regimes import REGIMES
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

    from bench.hot_switch import hot_switch_static as static
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
    from hetero_llm.switching.transfers import step_switch

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
        b0, b1 = home.buckets
        bytes_moved[network] = [
            sum(t.nbytes for t in step_switch(home, a, b, params=True, grads=g).transfers if t.src != t.dst)
            for a, b, g in ((home, b0, False), (b0, b1, True))
        ]
    assert bytes_moved["testbed"] == bytes_moved["loopback"] and min(bytes_moved["testbed"]) > 0


def test_switch_exchange_times_both_exchanges(tmp_path):
    """bench/comm/switch_exchange.py: the batched exchange in its own group and the plain one, every size."""
    import subprocess
    import sys

    from bench.common import benchlib

    cmd = [sys.executable, "-m", "bench.comm.switch_exchange", "--reps", "3", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=benchlib.clean_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    times = json.loads((tmp_path / "switch_exchange.json").read_text())["times_s"]
    assert set(times) == {"plain, default group", "batched, switch group"}
    for by_size in times.values():
        assert set(by_size) == {"1", "65536", "1048576"}
        assert all(len(t) == 3 and min(t) > 0 for t in by_size.values()), by_size
    assert "| exchange " in (tmp_path / "switch_exchange.md").read_text()


def test_hot_switch_with_cp_the_cap_splits_every_row_and_buckets_do_not_fit_beside_home(tmp_path):
    """``--max-cp 2`` (issue 36 5b): the planner may use CP, the cap is what cp 2 needs recomputing (so no device
    holds a whole row, even recomputing), and the buckets ``--buckets`` priced are run even where it rejects them,
    if they fit: under this cap they do not (the bucket layouts' buffer beside home's storage)."""
    import attrs

    from bench.hot_switch import hot_switch_static as static
    from hetero_llm.layout import Recompute

    cfg = attrs.evolve(hot.Config(), regime="a100-ib200", max_cp=2, hand=False, run_rejected=True)
    assert "max_cp = 2" in static.cluster_text(cfg, 1.0) and "max_cp = 1" in static.cluster_text(hot.Config(), 1.0)
    memory, found = static.static_candidates(cfg, tmp_path)
    assert memory < static.cap_gb(attrs.evolve(cfg, max_cp=1), tmp_path)  # tighter than without CP
    for regime in ("a100-ib200", "a100-nvlink"):  # the regimes' cluster files are what the bench plans on
        at = attrs.evolve(cfg, regime=regime)
        committed = (ROOT / "layouts" / "clusters" / f"hot_switch_cp_{regime.replace('-', '_')}.toml").read_text()
        assert committed.endswith("\n" + static.cluster_text(at, static.cap_gb(at, tmp_path), "adamw"))
    assert any(s.cp == 2 for x in found for p in x.layout.pipelines for s in p.stages)
    for x in found:  # every row split: over stages, TP or CP; one device never runs all layers of a row
        for p in x.layout.pipelines:
            assert len(p.stages) > 1 or len(p.stages[0].devices) > 1
            assert all(s.recompute is Recompute.FULL or len(p.stages) > 1 for s in p.stages)
    planned, verdict = static.planned_buckets(cfg, tmp_path, memory)
    # counted as the runtime holds them (one float32 buffer for the bucket layouts' shards beside home's storage,
    # held all step, and a bucket layout's own gradients), buckets do not fit beside home under this cap: nothing
    # is written, and the rejected set is not run either (the bench runs a rejected set only where it fits)
    assert planned is None and "not predicted to pay" in verdict[-1]
