"""The public API (hetero_llm.__all__, docs/api.md): its examples run, its answers equal the command lines' and the
library's own, it raises the CLI's one-line errors, ``import hetero_llm`` stays light, and a run that fails or
outlives its timeout is returned as such."""

from __future__ import annotations

import pytest

import hetero_llm as hl
from harness import LAYOUTS, invoke_cli
from hetero_llm import api
from hetero_llm.planner import evaluate, load_cluster

QUICKSTART = LAYOUTS / "quickstart.toml"


def test_all_names_the_api():
    """hetero_llm.__all__ is every public function and record of hetero_llm.api, and each resolves to it."""
    own = {
        name
        for name, value in vars(api).items()
        if not name.startswith("_") and getattr(value, "__module__", "") == "hetero_llm.api"
    }
    assert own <= set(hl.__all__)
    assert all(getattr(hl, name) is getattr(api, name) for name in hl.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hl.nope  # noqa: B018


def test_overrides_and_errors_are_the_command_lines():
    lay = hl.load(QUICKSTART, ["train.steps=7", "pipelines[0].stages[0].layers=2", "pipelines[0].stages[1].layers=2"])
    assert (lay.train.steps, [s.layers for s in lay.pipelines[0].stages]) == (7, [2, 2])
    assert hl.loads(QUICKSTART.read_text(), ["train.steps=7"], base_dir=LAYOUTS).train.steps == 7
    for bad in (["train.stpes=4"], ["pipelines[0].microbatches=3"], ["train.steps"]):
        with pytest.raises(hl.LayoutError) as e:
            hl.load(QUICKSTART, bad)
        cli = invoke_cli(QUICKSTART, "--dry-run", *(a for item in bad for a in ("--set", item)))
        assert cli.exit_code == 2 and cli.stderr == f"error: {e.value}\n"


def test_evaluate_is_hetero_plan_evaluate_per_rank():
    """A planned layout on its cluster file: the figures --evaluate --json prints, memory spread over the ranks
    in the compiled plan's rank order."""
    cluster_file, layout_file = LAYOUTS / "clusters" / "small_cpu.toml", LAYOUTS / "planned" / "small_cpu.toml"
    lay = hl.load(layout_file)
    pred = hl.evaluate(lay, cluster_file)
    ref = evaluate.to_json(evaluate.evaluate(load_cluster(cluster_file), lay, str(layout_file)))
    assert pred.step_time_s == ref["step_time"] and pred.tokens_per_s == ref["tokens_per_s"] and pred.fits
    plan = hl.compile_plan(lay)
    assert pred.memory_gb == tuple(ref["memory_gb"][r.pipeline][r.stage] for r in plan.ranks)
    # a layout changed by --set is priced as changed, on the same device kinds
    faster = hl.evaluate(hl.load(layout_file, ["train.global_batch=4", "pipelines[0].batch=2", "pipelines[1].batch=2"]))
    assert faster.step_time_s < hl.evaluate(lay).step_time_s


def test_evaluate_refuses_gpu_nodes_without_kinds():
    path = LAYOUTS / "planned" / "holmes_64gpu.toml"
    with pytest.raises(hl.LayoutError) as e:
        hl.evaluate(hl.load(path))
    assert str(e.value) == (
        f"{path}: cluster.nodes[0]: node 'ib0' has GPUs, whose device kind the layout does not say (evaluate it "
        "with the cluster file it was planned from, whose [plan.nodes] names the kinds)"
    )


def test_plan_cluster_writes_what_hetero_plan_writes(tmp_path):
    from hetero_llm.cli.plan import main

    planned = hl.plan_cluster(LAYOUTS / "clusters" / "small_cpu.toml", tmp_path / "api.toml")
    from click.testing import CliRunner

    result = CliRunner().invoke(main, [str(LAYOUTS / "clusters" / "small_cpu.toml"), "-o", str(tmp_path / "cli.toml")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "api.toml").read_text() == (tmp_path / "cli.toml").read_text()
    assert hl.layout_hash(planned.layout) == hl.layout_hash(hl.load(tmp_path / "api.toml"))
    with pytest.raises(hl.LayoutError, match="--top: must be >= 1, got 0"):
        hl.plan_cluster(LAYOUTS / "clusters" / "small_cpu.toml", top=0)


def test_layout_hash_is_the_layout():
    a = hl.load(QUICKSTART)
    assert hl.layout_hash(a) == hl.layout_hash(
        hl.loads(QUICKSTART.read_text(), file="elsewhere.toml", base_dir=LAYOUTS)
    )
    assert hl.layout_hash(a) != hl.layout_hash(hl.load(QUICKSTART, ["train.steps=5"]))


def test_a_bad_layout_is_raised_before_a_run_starts(tmp_path):
    with pytest.raises(hl.LayoutError, match="unknown key 'stpes'"):
        hl.run(QUICKSTART, tmp_path / "run", ["train.stpes=4"])
    assert not (tmp_path / "run").exists()
