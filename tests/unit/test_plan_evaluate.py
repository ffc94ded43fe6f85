"""``hetero-plan CLUSTER --evaluate LAYOUT``: the prediction for a given layout, without searching. Torch-free."""

from __future__ import annotations

import json

import attrs
import pytest
from click.testing import CliRunner

from harness import LAYOUTS
from hetero_llm import layout as layout_mod
from hetero_llm.cli.plan import main as plan_main
from hetero_llm.errors import LayoutError
from hetero_llm.layout import Schedule, dump
from hetero_llm.planner import evaluate, load_cluster, plan_cluster

CLUSTER = LAYOUTS / "clusters" / "small_cpu.toml"


def run(*args):
    return CliRunner().invoke(plan_main, [str(a) for a in args])


def test_the_planners_best_plan_evaluates_to_its_own_prediction(tmp_path):
    """Written out as a layout and read back, the planner's pick is priced exactly as the search priced it."""
    cluster = load_cluster(CLUSTER)
    result = plan_cluster(cluster, top=1)
    out = tmp_path / "planned.toml"
    assert run(CLUSTER, "-o", out).exit_code == 0
    ev = evaluate.evaluate(cluster, layout_mod.load(out), str(out))
    assert ev.candidate.key() == result.best.key()
    assert ev.score == result.score
    assert ev.devices == sum(s.group.tp for p in result.best.pipelines for s in p.stages)
    assert ev.tflops_per_device == pytest.approx(ev.model_flops / result.score.step_time / ev.devices / 1e12, rel=1e-12)


def test_text_and_json_say_the_same(tmp_path):
    planned = LAYOUTS / "planned" / "small_cpu.toml"
    text = run(CLUSTER, "--evaluate", planned)
    data = json.loads(run(CLUSTER, "--evaluate", planned, "--json").output)
    assert text.exit_code == 0 and text.output.startswith("PREDICTED by the planner's cost model (not measured):")
    assert f"step time {data['step_time']:.4g} s" in text.output
    assert f"MFU {data['mfu']:.1%}" in text.output
    assert data["fits"] and data["devices"] == 4 and len(data["memory_gb"]) == len(data["capacity_gb"])


def _layout(tmp_path, **train):
    lay = layout_mod.load(LAYOUTS / "planned" / "small_cpu.toml")
    lay = attrs.evolve(lay, train=attrs.evolve(lay.train, **train))
    path = tmp_path / "l.toml"
    dump(lay, path)
    return path


def test_a_schedule_the_cost_model_does_not_price_is_one_line(tmp_path):
    path = _layout(tmp_path, schedule=Schedule.DYNAMIC)
    result = run(CLUSTER, "--evaluate", path)
    assert (result.exit_code, result.output) == (
        2,
        f"error: {path}: train.schedule: 'dynamic' is not priced by the cost model (it prices gpipe, 1f1b, "
        "interleaved, zbh1; evaluate the layout with one of those)\n",
    )


def test_a_layout_of_another_model_or_cluster_is_refused(tmp_path):
    with pytest.raises(LayoutError, match="differs from the cluster file's"):
        evaluate.evaluate(load_cluster(CLUSTER), layout_mod.load(LAYOUTS / "quickstart.toml"), "q.toml")
    lay = layout_mod.load(LAYOUTS / "planned" / "small_cpu.toml")
    stage = attrs.evolve(lay.pipelines[0].stages[0], devices=("elsewhere:0",))
    moved = attrs.evolve(lay, pipelines=(attrs.evolve(lay.pipelines[0], stages=(stage, *lay.pipelines[0].stages[1:])),))
    with pytest.raises(LayoutError, match=r"pipelines\[0\]\.stages\[0\]\.devices: \['elsewhere:0'\] are not devices"):
        evaluate.candidate_of(load_cluster(CLUSTER), moved, "m.toml")


def test_a_layout_of_another_batch_precision_or_optimizer_is_one_line(tmp_path):
    """The cost model prices the cluster file's [train]: a layout of another global batch (whose tokens/s and MFU
    would be counted with the cluster file's batch), precision or optimizer is refused, not mispriced."""
    lay = layout_mod.load(LAYOUTS / "planned" / "small_cpu.toml")
    doubled = attrs.evolve(
        lay,
        train=attrs.evolve(lay.train, global_batch=2 * lay.train.global_batch),
        pipelines=tuple(attrs.evolve(p, batch=2 * p.batch, microbatches=2 * p.microbatches) for p in lay.pipelines),
    )
    path = tmp_path / "doubled.toml"
    dump(doubled, path)
    result = run(CLUSTER, "--evaluate", path)
    assert (result.exit_code, result.output) == (
        2,
        f"error: {path}: train.global_batch: 16 differs from the cluster file's 8 ({CLUSTER}): the cost model "
        "predicts the cluster file's [train] (set train.global_batch = 8 in the layout, or evaluate it with a "
        "cluster file of train.global_batch = 16)\n",
    )
    result = run(CLUSTER, "--evaluate", _layout(tmp_path, precision=layout_mod.Precision.BF16))
    assert result.exit_code == 2 and "train.precision: 'bf16' differs from the cluster file's 'fp32'" in result.output
    # an optimizer the cluster file's plan.optimizers allows is priced as the layout says; another is refused
    zero1 = _layout(tmp_path, optimizer=layout_mod.Optimizer.ADAMW_ZERO1)
    assert run(CLUSTER, "--evaluate", zero1).exit_code == 0
    only = tmp_path / "adamw_only.toml"
    only.write_text(CLUSTER.read_text().replace("[plan]\n", '[plan]\noptimizers = ["adamw"]\n', 1))
    result = run(only, "--evaluate", zero1)
    assert result.exit_code == 2 and "train.optimizer: 'adamw_zero1' differs" in result.output


def _cp_layout(tmp_path):
    lay = layout_mod.load(LAYOUTS / "planned" / "small_cpu.toml")
    first, second = lay.pipelines[0].stages
    stage = attrs.evolve(first, devices=("fast0:0", "fast0:1"), cp=2)
    pipe = attrs.evolve(lay.pipelines[0], batch=8, stages=(stage, second))
    path = tmp_path / "cp.toml"
    dump(attrs.evolve(lay, pipelines=(pipe,)), path)
    return path


def test_a_layout_with_context_parallelism_is_priced_as_cp_not_as_tp(tmp_path):
    """A stage of cp 2 on two devices is not a TP 2 stage: its tokens are halved, its ring priced (planner/context.py)."""
    cp_path = _cp_layout(tmp_path)
    tp_path = tmp_path / "tp.toml"
    tp_path.write_text(cp_path.read_text().replace("cp = 2\n", ""))
    cp_json, tp_json = (run(CLUSTER, "--evaluate", p, "--json") for p in (cp_path, tp_path))
    assert cp_json.exit_code == 0 and tp_json.exit_code == 0, cp_json.output + tp_json.output
    cp_eval, tp_eval = json.loads(cp_json.output), json.loads(tp_json.output)
    assert cp_eval["fits"] and tp_eval["fits"]
    assert cp_eval["step_time"] != tp_eval["step_time"] and cp_eval["memory_gb"] != tp_eval["memory_gb"]


def test_context_parallelism_with_unfused_attention_is_refused_not_mispriced(tmp_path):
    """The ring is priced for flash attention's blocks; unfused attention holds the whole S x S scores."""
    path = _cp_layout(tmp_path)
    unfused = tmp_path / "unfused.toml"
    unfused.write_text(CLUSTER.read_text().replace("[plan]\n", '[plan]\nattention = "unfused"\n', 1))
    result = run(unfused, "--evaluate", path)
    assert (result.exit_code, result.output) == (
        2,
        f"error: {path}: pipelines[0].stages[0].cp: 2: context parallelism is priced for flash attention only, but "
        f"the cluster file's plan.attention is 'unfused' (evaluate it with cp = 1, or plan.attention = 'flash')\n",
    )
