"""Measured profiles (hetero-plan --profile): the times the cost model reads instead of peak FLOPS, for the kinds
and shapes they name, every bad profile and flag as one line, and a profile measured on this machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_planner import run_plan, small_cluster

from harness import LAYOUTS
from hetero_llm.planner.candidates import TPGroup
from hetero_llm.planner.cluster import load_cluster
from hetero_llm.planner.cost import PlannerCostModel

SMALL = LAYOUTS / "clusters" / "small_cpu.toml"


def write_profile(path: Path, cluster, kinds: dict[str, tuple[float, float, float, float]], **model_edit) -> Path:
    from hetero_llm.planner import profile as prof

    shape = prof.model_shape(cluster.model, cluster.train.precision) | model_edit
    path.write_text(
        json.dumps(
            {"format": prof.FORMAT, "model": shape, "kinds": {k: dict(zip(prof.TIMES, v)) for k, v in kinds.items()}}
        )
    )
    return path


def test_profile_times_replace_peak_flops_for_the_kinds_it_names(tmp_path):
    """Reading a profile is torch-free; a profiled kind's stage times are the measured per-sequence times x
    rows / TP (+ a forward when recomputing), its W the FLOP model's share; other kinds keep peak FLOPS."""
    base = load_cluster(SMALL)
    write_profile(tmp_path / "prof.json", base, {"cpu2x": (1e-3, 2.5e-3, 4e-4, 6e-4)})
    path = small_cluster(tmp_path, plan="", edit=lambda t: t.replace("[plan]\n", '[plan]\nprofile = "prof.json"\n'))
    c = load_cluster(path)
    cost, flop = PlannerCostModel(c), PlannerCostModel(base)
    fast = TPGroup("fast0", "fast", ("fast0:0", "fast0:1"), c.node("fast0").kind)
    slow = TPGroup("slow0", "slow", ("slow0:0",), c.node("slow0").kind)
    f, b, w, _ = cost.stage_times(fast, 3, True, 4, False)
    tp_f, tp_b = flop.stage_times(fast, 3, True, 4, False)[3] / 2, flop.stage_times(fast, 3, True, 4, False)[3] / 2
    assert f - tp_f == pytest.approx(4 / 2 * (3 * 1e-3 + 4e-4))
    assert b - tp_b == pytest.approx(4 / 2 * (3 * 2.5e-3 + 6e-4))
    share = cost.layer_matmul_flops() / (2 * cost.layer_forward_flops())
    assert w == pytest.approx(4 / 2 * (3 * 2.5e-3 * share + 3e-4))
    rc = cost.stage_times(fast, 3, False, 4, True)
    assert rc[1] - cost.stage_times(fast, 3, False, 4, False)[1] == pytest.approx(4 / 2 * 3 * 1e-3 + tp_b)
    assert cost.stage_times(slow, 3, True, 4, False) == flop.stage_times(slow, 3, True, 4, False)
    # --profile-file replaces [plan] profile; the plan is searched under the measured times
    other = write_profile(tmp_path / "other.json", base, {"cpu": (1e-3, 2e-3, 1e-4, 2e-4)})
    assert load_cluster(path, other).profile.get("cpu2x") is None
    res = run_plan(path, "-o", tmp_path / "out.toml", "--profile-file", other)
    assert res.exit_code == 0, res.stderr


BAD_PROFILES = [
    (
        "missing.json",
        None,
        "cannot read profile '{p}': No such file or directory (write one with: hetero-plan {c} --profile {p})",
    ),
    (
        "bad.json",
        "{",
        "profile '{p}' is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
        "(char 1)); write one with: hetero-plan {c} --profile {p}",
    ),
    (
        "fmt.json",
        '{"kinds": {}}',
        "profile '{p}' is not a hetero-plan profile (expected format 'hetero-plan profile 1' "
        "and a 'kinds' table); write one with: hetero-plan {c} --profile {p}",
    ),
    (
        "shape.json",
        {"hidden": 64},
        "profile '{p}' was measured with hidden = 64, the cluster's model has 32; measure "
        "again (write one with: hetero-plan {c} --profile {p})",
    ),
    (
        "neg.json",
        {"cpu": (1e-3, -1.0, 1e-4, 1e-4)},
        "profile '{p}': kinds.cpu.layer_backward_s must be a number of "
        "seconds > 0, got -1.0; write one with: hetero-plan {c} --profile {p}",
    ),
]


@pytest.mark.parametrize("name,content,message", BAD_PROFILES, ids=[b[0] for b in BAD_PROFILES])
@pytest.mark.parametrize("via", ["key", "flag"])
def test_bad_profiles(tmp_path, name, content, message, via):
    base = load_cluster(SMALL)
    p = tmp_path / name
    if isinstance(content, str):
        p.write_text(content)
    elif isinstance(content, dict) and "hidden" in content:
        write_profile(p, base, {"cpu": (1e-3,) * 4}, **content)
    elif content is not None:
        write_profile(p, base, content)
    if via == "key":
        path = small_cluster(tmp_path, edit=lambda t: t.replace("[plan]\n", f'[plan]\nprofile = "{name}"\n'))
        args, where = (), "plan.profile"
    else:
        path, args, where = SMALL, ("--profile-file", p), "--profile-file"
    res = run_plan(path, "-o", tmp_path / "out.toml", *args)
    shown = p if via == "flag" else path.parent / name
    assert res.stderr == f"error: {path}: {where}: " + message.format(p=shown, c=path) + "\n"
    assert res.exit_code == 2 and not (tmp_path / "out.toml").exists()


def test_profile_flag_errors(tmp_path):
    res = run_plan(SMALL)
    assert (
        res.stderr
        == f"error: {SMALL}: -o: missing: name the layout file to write (-o LAYOUT.toml), print the plans with "
        "--explain or --json, or measure with --profile FILE\n"
        and res.exit_code == 2
    )
    res = run_plan(SMALL, "--profile", tmp_path / "p.json", "--device", "cpu")
    assert (
        res.stderr
        == f"error: {SMALL}: --kind: name the device kind to record the times under (nodes on 'cpu' have "
        "kinds ['cpu', 'cpu2x']; the cluster's kinds: cpu, cpu2x)\n"
        and res.exit_code == 2
    )
    res = run_plan(SMALL, "--profile", tmp_path / "p.json", "--kind", "h100-sxm")
    assert res.stderr == f"error: {SMALL}: --kind: no node of the cluster has kind 'h100-sxm' (kinds: cpu, cpu2x)\n"
    (tmp_path / "junk.json").write_text("junk")
    res = run_plan(SMALL, "--profile", tmp_path / "junk.json", "--kind", "cpu", "--device", "cpu")
    assert res.stderr.startswith(f"error: {SMALL}: --profile: '{tmp_path / 'junk.json'}' exists and is not a profile (")
    assert res.exit_code == 2 and not (tmp_path / "p.json").exists()


def test_profile_measures_this_machine_and_the_plan_reads_it(tmp_path):
    """hetero-plan --profile times the library's block and head (torch) and adds kinds to one file, which
    the planner then reads."""
    pytest.importorskip(
        "torch",
        reason="measuring a profile runs the model (reading one does not); runs wherever torch is installed, as in CI",
    )
    out = tmp_path / "p.json"
    for kind in ("cpu", "cpu2x"):  # (a noisy machine's measurement is refused: tests/unit/test_plan_explain.py)
        res = run_plan(SMALL, "--profile", out, "--kind", kind, "--device", "cpu", "--max-spread", "1000")
        assert res.exit_code == 0, res.stderr
        assert res.stdout.startswith(f"profiled kind '{kind}' on cpu (")
    data = json.loads(out.read_text())
    assert set(data["kinds"]) == {"cpu", "cpu2x"} and data["model"]["hidden"] == 32
    c = load_cluster(SMALL, out)
    for kind in ("cpu", "cpu2x"):
        t = c.profile.get(kind)
        assert 0 < t.head_forward_s < 1 and 0 < t.layer_forward_s < 1 and 0 < t.layer_backward_s < 1
    res = run_plan(SMALL, "-o", tmp_path / "o.toml", "--profile-file", out)
    assert res.exit_code == 0, res.stderr


def test_profile_applies_only_at_its_shapes(tmp_path):
    """hetero-plan --buckets plans other sequence lengths: a profile measured at the cluster's seq_len is not
    used there (the FLOP model is)."""
    import attrs

    base = load_cluster(SMALL)
    c = load_cluster(SMALL, write_profile(tmp_path / "p.json", base, {"cpu2x": (1e-3, 2e-3, 1e-4, 2e-4)}))
    fast = TPGroup("fast0", "fast", ("fast0:0",), c.node("fast0").kind)
    assert PlannerCostModel(c).stage_times(fast, 2, False, 1, False)[0] == pytest.approx(2e-3)
    shorter = attrs.evolve(c, model=attrs.evolve(c.model, seq_len=8))
    flop = attrs.evolve(base, model=attrs.evolve(base.model, seq_len=8))
    assert PlannerCostModel(shorter).stage_times(fast, 2, False, 1, False) == PlannerCostModel(flop).stage_times(
        fast, 2, False, 1, False
    )
