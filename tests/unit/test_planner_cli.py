"""hetero-plan's command line and cluster files: the written layout, JSON and --explain, every bad key, flag and file
as one line, an infeasible cluster named by stage, the example layout and the planner doc's key list. Torch-free.
"""

from __future__ import annotations

import json

import pytest
from helpers_planner import run_plan, small_cluster

from harness import LAYOUTS
from hetero_llm import layout as layout_mod
from hetero_llm.planner import plan_cluster
from hetero_llm.planner.cluster import load_cluster
from hetero_llm.planner.output import layout_text

SMALL = LAYOUTS / "clusters" / "small_cpu.toml"


def test_cli_writes_json_and_explains(tmp_path):
    out = tmp_path / "plan.toml"
    res = run_plan(SMALL, "-o", out, "--json", "--top", "2")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert (
        len(data["plans"]) == 2
        and data["plans"][0]["predicted"]["step_time"] <= data["plans"][1]["predicted"]["step_time"]
    )
    res = run_plan(SMALL, "-o", out, "--explain", "--top", "3")
    assert res.exit_code == 0 and "why #1 wins" in res.stdout and "#3" in res.stdout
    assert layout_mod.load(out).pipelines


SCHEDULES = 'schedules = ["1f1b", "zbh1", "interleaved"]\n'
BAD = [
    ("max_tp = 2\n", "max_tp = -1\n", "plan.max_tp: must be >= 0 (0 = a node's device count), got -1"),
    (
        SCHEDULES,
        'schedules = ["1f1b", "pipedream"]\n',
        "plan.schedules[1]: unknown schedule 'pipedream' (the planner chooses from 1f1b, zbh1, interleaved, gpipe)",
    ),
    (
        SCHEDULES,
        'schedules = ["dynamic"]\n',
        "plan.schedules[0]: 'dynamic' runs what is ready at run time: the planner's simulator cannot price it "
        "(plan with '1f1b', then set train.schedule = 'dynamic' in the written layout)",
    ),
    (
        SCHEDULES,
        "schedules = []\n",
        "plan.schedules: needs at least one schedule (from 1f1b, zbh1, interleaved, gpipe)",
    ),
    (
        "[plan]\n",
        '[plan]\noptimizers = ["adamw", "sgd"]\n',
        "plan.optimizers[1]: unknown optimizer 'sgd' (the planner chooses from adamw, adamw_zero1)",
    ),
    (
        "[plan]\n",
        "[plan]\noptimizers = []\n",
        "plan.optimizers: needs at least one optimizer (from adamw, adamw_zero1)",
    ),
    ("[plan]\n", "[plan]\nmemory_margin = 1.5\n", "plan.memory_margin: must be in [0, 1), got 1.5"),
    ("[plan]\n", "[plan]\ntime_budget_s = -2\n", "plan.time_budget_s: must be >= 0 (0 = no limit), got -2"),
    (
        "[plan]\n",
        "[plan]\naction_overhead_us = -5\n",
        "plan.action_overhead_us: must be a number of microseconds >= 0 (0 = none), got -5",
    ),
    (
        "[plan]\n",
        "[plan]\np2p_latency_us = -0.5\n",
        "plan.p2p_latency_us: must be a number of microseconds >= 0 (0 = none), got -0.5",
    ),
    ("max_tp = 2\n", "max_tpp = 2\n", "plan.max_tpp: unknown key 'max_tpp' (did you mean 'max_tp'?)"),
    (
        "[plan.nodes]\n",
        '[plan.nodes]\nslow0 = "h100"\n',
        "plan.nodes.slow0: unknown device kind 'h100' (known: a100-40g, a100-80g, "
        "a6000, cpu, cpu2x, h100-sxm, h200-sxm, rtx3080ti, rtx3090, rtx4090; or add [plan.kinds.h100])",
    ),
    (
        "[plan.nodes]\n",
        '[plan.nodes]\n"gpu*" = "cpu"\n',
        "plan.nodes.gpu*: matches no node (nodes: fast0, slow0, slow1)",
    ),
    (
        "tflops = 0.01\n",
        "tflops = 0.01\nlink_gbs = 3\n",
        "plan.kinds.cpu2x.link_gbs: unknown key 'link_gbs' (did you mean 'link_gbps'?)",
    ),
    ("memory_gb = 8\n", "memory_gb = -8\n", "plan.kinds.cpu2x.memory_gb: must be > 0, got -8"),
    (
        "[plan.nodes]\n",
        "[plan.nics]\nfast0 = 0\n[plan.nodes]\n",
        "plan.nics.fast0: expected a number of NICs >= 1, got 0",
    ),
    (
        "max_tp = 2\n",
        "max_tp = 2\ngrad_bytes = 8\n",
        "plan.grad_bytes: must be 4 (float32 gradients) or 2 (fp16/bf16), got 8",
    ),
    (
        "tflops = 0.01\n",
        "tflops = 0.01\nlaunch_us = -1\n",
        "plan.kinds.cpu2x.launch_us: must be a number of microseconds >= 0, got -1",
    ),
]


@pytest.mark.parametrize("old,new,message", BAD, ids=[b[2].split(":")[0] for b in BAD])
def test_bad_plan_keys(tmp_path, old, new, message):
    assert old in SMALL.read_text()
    path = small_cluster(tmp_path, edit=lambda t: t.replace(old, new, 1))
    res = run_plan(path, "-o", tmp_path / "out.toml")
    assert res.stderr == f"error: {path}: {message}\n" and res.exit_code == 2 and res.stdout == ""
    assert not (tmp_path / "out.toml").exists()


def test_gpu_node_without_a_kind(tmp_path):
    path = small_cluster(
        tmp_path, edit=lambda t: t.replace('name = "slow1"\n', 'name = "slow1"\ndevices = ["cuda:0"]\n')
    )
    res = run_plan(path, "-o", tmp_path / "out.toml")
    assert res.stderr == (
        f"error: {path}: cluster.nodes[2]: node 'slow1' has no device kind (add it to [plan.nodes], "
        'e.g. slow1 = "a100-80g"; kinds: a100-40g, a100-80g, a6000, cpu, cpu2x, h100-sxm, h200-sxm, '
        "rtx3080ti, rtx3090, rtx4090)\n"
    )
    assert res.exit_code == 2


def test_bad_flags_and_files(tmp_path):
    res = run_plan(SMALL, "-o", tmp_path / "o.toml", "--top", "0")
    assert res.stderr == f"error: {SMALL}: --top: must be >= 1, got 0\n" and res.exit_code == 2
    res = run_plan(tmp_path / "none.toml", "-o", tmp_path / "o.toml")
    assert (
        res.stderr == f"error: {tmp_path / 'none.toml'}: no such file (pass a TOML file with [model], [train] and "
        "[cluster])\n"
    )
    lay = LAYOUTS / "reference" / "hexiscale.toml"
    res = run_plan(lay, "-o", tmp_path / "o.toml")
    assert (
        res.stderr == f"error: {lay}: pipelines: the file already has [[pipelines]] (the planner writes them: "
        "start from a copy without them)\n"
    )


def test_infeasible_cluster_names_the_stage_and_by_how_much(tmp_path):
    path = small_cluster(
        tmp_path,
        edit=lambda t: t.replace("memory_gb = 8", "memory_gb = 0.0001").replace(
            "[plan.nodes]",
            "[plan.kinds.tiny]\ntflops = 0.005\nmemory_gb = 0.0001\nlink_gbps = 40\n"
            'mem_bw_gbs = 10\n[plan.nodes]\n"slow*" = "tiny"',
        ),
    )
    res = run_plan(path, "-o", tmp_path / "out.toml")
    assert res.exit_code == 2 and res.stdout == ""
    line = res.stderr
    assert (
        line.startswith(f"error: {path}: cluster: nothing fits in memory: the closest plan's pipeline ")
        and "GB per device but has 9e-05 GB (" in line
        and line.count("\n") == 1
    )


def test_example_layout_is_the_plan_of_its_cluster_file():
    """layouts/planned/small_cpu.toml is what hetero-plan writes for layouts/clusters/small_cpu.toml (and
    tests/integration/test_invariance.py trains it against layouts/reference/hexiscale.toml, as every example)."""
    c = load_cluster(SMALL)
    result = plan_cluster(c)
    written = (LAYOUTS / "planned" / "small_cpu.toml").read_text()
    assert written == layout_text(c, result.best, result.score, result.seed_score)


def test_planner_doc_lists_every_key():
    from hetero_llm.planner.cluster import schema_markdown

    assert schema_markdown() in (LAYOUTS.parent / "docs" / "planner.md").read_text(), (
        "docs/planner.md is stale: regenerate its tables with python -c 'from hetero_llm.planner.cluster import "
        "schema_markdown; print(schema_markdown())'"
    )


def test_emulated_action_seconds_are_read_per_rank(monkeypatch):
    from hetero_llm.runtime.emulation import Emulation

    monkeypatch.setenv("HETERO_EMULATE_ACTION_S", "0:F=0.02;B=0.04,1:F=0.01;B=0.02;I=0.012;W=0.008")
    from hetero_llm.schedule import Kind

    assert dict(Emulation.from_env(1).seconds) == {Kind.F: 0.01, Kind.B: 0.02, Kind.I: 0.012, Kind.W: 0.008}
    assert Emulation.from_env(0).active and not Emulation.from_env(2).active
