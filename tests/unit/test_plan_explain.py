"""hetero-plan explains itself and gives the same plan on any machine: a budget counted in work (the wall-clock
cap a safety net the output names), idle devices and why, --explain/--json without -o, input errors before
the search, a bounded global batch, allowed schedules only, a --profile that refuses noisy numbers.
Torch-free (the CLI in this process; the determinism test runs it in subprocesses)."""

from __future__ import annotations

import json
import re

import pytest
from helpers_plan import run_plan
from helpers_plan_explain import edited

from harness import LAYOUTS
from hetero_llm import layout as layout_mod
from hetero_llm.planner import with_optimizer
from hetero_llm.planner.cluster import load_cluster
from hetero_llm.planner.cost import PlannerCostModel, TPGroup
from hetero_llm.planner.memory import ONE_IN_FLIGHT
from hetero_llm.planner.profile import KindTimes

SMALL = LAYOUTS / "clusters" / "small_cpu.toml"


def test_a_search_cut_by_the_time_cap_says_so(tmp_path):
    cluster = edited(tmp_path, lambda t: t.replace("[plan]\n", "[plan]\ntime_budget_s = 0.000001\n", 1))
    note = (
        "the search was cut by the time cap (plan.time_budget_s = 1e-06 s) before its work budget "
        "(plan.max_evals) was spent: this plan depends on the machine's speed and load (rerun on an idle "
        "machine, or raise plan.time_budget_s or lower plan.max_evals)"
    )
    out = tmp_path / "plan.toml"
    res = run_plan(cluster, "-o", out)
    assert res.exit_code == 0, res.stderr
    assert f"\nNOTE: {note}\n" in res.stdout
    assert out.read_text().splitlines()[1] == f"# NOTE: {note}."
    layout_mod.load(out)  # still a layout
    res = run_plan(cluster, "--json")
    assert json.loads(res.stdout)["cut_by_time"] is True
    # without the cap the same cluster is not cut, and the header has no note
    res = run_plan(SMALL, "--json", "-o", out)
    assert json.loads(res.stdout)["cut_by_time"] is False and "NOTE" not in out.read_text()


def test_bad_max_evals(tmp_path):
    cluster = edited(tmp_path, lambda t: t.replace("[plan]\n", "[plan]\nmax_evals = -1\n", 1))
    res = run_plan(cluster, "--json")
    assert (
        res.stderr == f"error: {cluster}: plan.max_evals: must be >= 0 (0 = 400 + 8 per device, at most 2500), got -1\n"
    )
    assert res.exit_code == 2 and res.stdout == ""


def test_explain_and_json_need_no_output_file(tmp_path):
    res = run_plan(SMALL, "--explain", "--top", "2")
    assert res.exit_code == 0, res.stderr
    assert "why #1 wins" in res.stdout
    assert res.stdout.endswith("wrote nothing (write the layout with -o LAYOUT.toml)\n")
    res = run_plan(SMALL, "--json", "--top", "2")
    data = json.loads(res.stdout)
    assert len(data["plans"]) == 2 and data["written"] is None and data["idle"] == []
    # the same plan as the one -o writes
    out = tmp_path / "plan.toml"
    written = json.loads(run_plan(SMALL, "--json", "--top", "2", "-o", out).stdout)
    assert written["plans"] == data["plans"] and written["written"] == str(out)
    assert sorted(tmp_path.iterdir()) == [out]
    res = run_plan(SMALL)
    assert res.stderr == (
        f"error: {SMALL}: -o: missing: name the layout file to write (-o LAYOUT.toml), print the plans with "
        "--explain or --json, or measure with --profile FILE\n"
    )
    assert res.exit_code == 2


def with_idle_nodes(text: str) -> str:
    """small_cpu plus a node too small for one layer (tiny0) and one far too slow to pay (snail0)."""
    nodes = '[[cluster.nodes]]\nname = "tiny0"\ndomain = "slow"\n[[cluster.nodes]]\nname = "snail0"\ndomain = "slow"\n'
    kinds = (
        "[plan.kinds.tiny]\ntflops = 0.005\nmemory_gb = 0.0001\nlink_gbps = 40\nmem_bw_gbs = 10\n"
        "[plan.kinds.snail]\ntflops = 0.00001\nmemory_gb = 8\nlink_gbps = 40\nmem_bw_gbs = 10\n"
    )
    text = text.replace("[plan]\n", nodes + "\n[plan]\n", 1)
    return text.replace('fast0 = "cpu2x"\n', 'fast0 = "cpu2x"\ntiny0 = "tiny"\nsnail0 = "snail"\n') + kinds


def test_idle_devices_are_named_with_the_reason(tmp_path):
    cluster = edited(tmp_path, with_idle_nodes)
    c = load_cluster(cluster)
    tiny = TPGroup("tiny0", "slow", ("tiny0:0",), c.node("tiny0").kind)
    res = run_plan(cluster, "--json")
    data = json.loads(res.stdout)
    cost = PlannerCostModel(with_optimizer(c, data["plans"][0]["optimizer"]))  # the plan's train.optimizer
    # the least any stage needs (ZeRO-1: no moments at all)
    need = cost.stage_memory(tiny, 1, False, False, 1, True, ONE_IN_FLIGHT, moments=0.0 if cost.zero1 else None)
    small = (
        f"too small for any stage: one layer needs {need / 1e9:.3g} GB per device at TP 1, a tiny has "
        "9e-05 GB (after plan.memory_margin)"
    )
    slow = "left idle: the plan is predicted faster without it"
    assert data["idle"] == [{"device": "tiny0:0", "reason": small}, {"device": "snail0:0", "reason": slow}]
    used = {d for p in data["plans"][0]["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert used == {"fast0:0", "fast0:1", "slow0:0", "slow1:0"}
    res = run_plan(cluster, "--explain")
    assert f"\nidle: 1 device (tiny0:0): {small}\nidle: 1 device (snail0:0): {slow}\n" in res.stdout


def no_search(monkeypatch):
    import hetero_llm.planner

    def refuse(*a, **k):
        raise AssertionError("the search ran")

    monkeypatch.setattr(hetero_llm.planner, "plan_cluster", refuse)


def nccl(text: str) -> str:
    """small_cpu under NCCL, a GPU per device: fast0 cuda:0 and cuda:1, slow0 cuda:2, slow1 cuda:3 (one host)."""
    return (
        text.replace("[cluster]\n", '[cluster]\nbackend = "nccl"\n', 1)
        .replace('devices = ["cpu", "cpu"]', 'devices = ["cuda:0", "cuda:1"]')
        .replace('name = "slow0"\n', 'name = "slow0"\ndevices = ["cuda:2"]\n')
        .replace('name = "slow1"\n', 'name = "slow1"\ndevices = ["cuda:3"]\n')
        .replace('fast0 = "cpu2x"\n', 'fast0 = "rtx4090"\n"slow*" = "rtx3090"\n')
    )


BEFORE = [
    (
        lambda t: t.replace("heads = 4 ", "heads = 5 "),
        "model.heads: 5 heads do not divide hidden 32 (pick a divisor of 32)",
    ),
    (
        lambda t: nccl(t).replace('devices = ["cuda:2"]', 'devices = ["cuda:1"]'),
        "cluster.nodes[1].devices[0]: device 'slow0:0' is cuda:1 on host 127.0.0.1, like 'fast0:1' (NCCL runs "
        "one rank per GPU and a plan may use every device: give each node its own GPUs, or use backend = 'gloo')",
    ),
    (
        lambda t: nccl(t).replace('devices = ["cuda:3"]', 'devices = ["cpu"]'),
        "cluster.nodes[2].devices[0]: device 'slow1:0' is 'cpu' but cluster.backend is 'nccl' (NCCL needs CUDA "
        "devices: list 'cuda:N' devices or use backend = 'gloo')",
    ),
    (
        lambda t: t.replace("log_every = 1\n", 'log_every = 1\ncompile = "blocks"\n').replace(
            'schedules = ["1f1b", "zbh1", "interleaved"]', 'schedules = ["zbh1"]'
        ),
        "plan.schedules: only 'zbh1', whose split backward train.compile = 'blocks' cannot compile (allow "
        "'1f1b' or 'interleaved', or set train.compile = 'none')",
    ),
    (
        lambda t: t.replace("global_batch = 8 ", "global_batch = 1000000000 "),
        "train.global_batch: 1000000000 sequences per step is more than the planner searches (at most 65536: "
        "plan a smaller global batch, then scale the pipelines' batch and microbatches)",
    ),
]


@pytest.mark.parametrize("edit,message", BEFORE, ids=["heads", "nccl-host", "nccl-cpu", "zbh1-compiled", "huge-batch"])
def test_input_errors_come_before_the_search_and_name_the_cluster_file(tmp_path, monkeypatch, edit, message):
    cluster = edited(tmp_path, edit)
    no_search(monkeypatch)
    for args in (["-o", tmp_path / "out.toml"], ["--json"]):
        res = run_plan(cluster, *args)
        assert res.stderr == f"error: {cluster}: {message}\n", res.stderr
        assert res.exit_code == 2 and res.stdout == ""
    assert not (tmp_path / "out.toml").exists()


def test_a_relative_data_path_is_checked_before_the_search(tmp_path, monkeypatch):
    (tmp_path / "corpus.txt").write_text("hello world " * 20)
    cluster = edited(
        tmp_path,
        lambda t: t.replace('kind = "grammar"', 'kind = "text"\npath = "corpus.txt"').replace(
            "vocab = 64\n", "vocab = 256\n"
        ),
    )
    no_search(monkeypatch)
    res = run_plan(cluster, "-o", tmp_path / "elsewhere" / "out.toml")
    assert res.stderr == (
        f"error: {cluster}: data.path: 'corpus.txt' is relative to the cluster file: write the layout next to it, "
        "or make data.path absolute\n"
    )
    assert res.exit_code == 2 and not (tmp_path / "elsewhere").exists()


def test_a_compiled_model_is_planned_without_zbh1(tmp_path):
    """train.compile = 'blocks' cannot compile ZB-H1's split backward: the planner leaves that schedule out."""
    cluster = edited(tmp_path, lambda t: t.replace("log_every = 1\n", 'log_every = 1\ncompile = "blocks"\n'))
    out = tmp_path / "plan.toml"
    res = run_plan(cluster, "-o", out, "--json", "--top", "20")
    assert res.exit_code == 0, res.stderr
    assert "zbh1" not in {p["schedule"] for p in json.loads(res.stdout)["plans"]}
    assert layout_mod.load(out).train.compile.value == "blocks"


def test_each_gpu_of_its_own_plans(tmp_path):
    """The NCCL cluster above with a GPU per device (on one host, or cuda:1 twice on two): no error, and the
    plan is a layout."""
    cluster = edited(tmp_path, nccl)
    res = run_plan(cluster, "-o", tmp_path / "out.toml")
    assert res.exit_code == 0, res.stderr
    assert layout_mod.load(tmp_path / "out.toml").cluster.backend.value == "nccl"
    cluster = edited(
        tmp_path, lambda t: nccl(t).replace('devices = ["cuda:2"]', 'devices = ["cuda:1"]\nhost = "other"')
    )
    res = run_plan(cluster, "-o", tmp_path / "out.toml")
    assert res.exit_code == 0, res.stderr
    assert layout_mod.load(tmp_path / "out.toml").cluster.backend.value == "nccl"


def test_only_the_allowed_schedules_are_written(tmp_path):
    """With plan.schedules = ["interleaved"] no plan, hetero-place's seeds included, has another schedule."""
    cluster = edited(
        tmp_path, lambda t: t.replace('schedules = ["1f1b", "zbh1", "interleaved"]', 'schedules = ["interleaved"]')
    )
    out = tmp_path / "plan.toml"
    res = run_plan(cluster, "-o", out, "--json", "--top", "20")
    assert res.exit_code == 0, res.stderr
    assert {p["schedule"] for p in json.loads(res.stdout)["plans"]} == {"interleaved"}
    assert layout_mod.load(out).train.schedule.value == "interleaved"
    from hetero_llm.planner import place_seeds

    assert {s.schedule for s in place_seeds(load_cluster(cluster))} <= {"interleaved"}


def fake_measure(spread: float):
    """``measure`` without torch: the median times of small_cpu-sized layers, the layer backward's repeats
    ranging ``spread`` of its median."""

    def measure(model, precision, device):
        times = KindTimes(1e-3, 2e-3, 1e-4, 2e-4)
        mmm = {
            k: [v, v, v]
            for k, v in zip(
                ("layer_forward_s", "layer_backward_s", "head_forward_s", "head_backward_s"), (1e-3, 2e-3, 1e-4, 2e-4)
            )
        }
        mmm["layer_backward_s"] = [2e-3, 2e-3, 2e-3 * (1 + spread)]
        return times, {"device": device, "threads": 1, "repeats": 7, "min_median_max_s": mmm}

    return measure


def test_profile_reports_its_spread_and_refuses_a_noisy_one(tmp_path, monkeypatch):
    from hetero_llm import api
    from hetero_llm.planner import profile

    out = tmp_path / "p.json"
    monkeypatch.setattr(api, "_torch", lambda f: None)
    monkeypatch.setattr(profile, "measure", fake_measure(0.8))
    res = run_plan(SMALL, "--profile", out, "--kind", "cpu", "--device", "cpu")
    assert res.stderr == (
        f"error: {SMALL}: --profile: the measurement is noisy: layer_backward_s ranged 2 / 2 / 3.6 ms (min / "
        "median / max of 7 repeats), a spread of 80%, over --max-spread 50%; nothing written (rerun on an idle "
        "machine)\n"
    )
    assert res.exit_code == 2 and not out.exists()
    res = run_plan(SMALL, "--profile", out, "--kind", "cpu", "--device", "cpu", "--max-spread", "1")
    assert res.exit_code == 0, res.stderr
    assert (
        "(medians of 7 repeats; widest spread 80%, layer_backward_s: min / median / max 2 / 2 / 3.6 ms)" in res.stdout
    )
    assert json.loads(out.read_text())["kinds"]["cpu"]["info"]["min_median_max_s"]["layer_backward_s"][2] == 2e-3 * (
        1 + 0.8
    )
    monkeypatch.setattr(profile, "measure", fake_measure(0.1))
    res = run_plan(SMALL, "--profile", out, "--kind", "cpu", "--device", "cpu")
    assert res.exit_code == 0 and "widest spread 10%" in res.stdout
    res = run_plan(SMALL, "--profile", out, "--kind", "cpu", "--device", "cpu", "--max-spread", "-1")
    assert res.stderr == f"error: {SMALL}: --max-spread: must be >= 0, got -1\n" and res.exit_code == 2


def test_a_real_measurement_with_no_spread_allowed_is_refused(tmp_path):
    """With torch: --max-spread 0 refuses any measurement whose repeats differ at all (timings always do)."""
    pytest.importorskip("torch", reason="measuring a profile runs the model (reading one does not)")
    out = tmp_path / "p.json"
    res = run_plan(SMALL, "--profile", out, "--kind", "cpu", "--device", "cpu", "--max-spread", "0")
    pattern = (
        rf"error: {re.escape(str(SMALL))}: --profile: the measurement is noisy: (layer|head)_(forward|backward)_s "
        r"ranged \S+ / \S+ / \S+ ms \(min / median / max of 7 repeats\), a spread of \d+%, over --max-spread 0%; "
        r"nothing written \(rerun on an idle machine\)\n"
    )
    assert re.fullmatch(pattern, res.stderr), res.stderr
    assert res.exit_code == 2 and res.stdout == "" and not out.exists()
