"""The planner's predicted step times against runs with emulated device speeds.

    python bench/plan_vs_measured.py            # 10 of the planner's ranked plans for a 4-slot CPU cluster
    python bench/plan_vs_measured.py --quick    # 2 plans, 2 steps, devices 4x faster (the test suite runs this)

Emulated devices: every compute action of a rank lasts the duration the cost model gives its stage
(forward, backward, and for ZB-H1 the input- and weight-gradient parts; ``HETERO_EMULATE_ACTION_S``):
the real small computation runs inside it and the rank sleeps the rest, so four ranks share two cores
without contending, while activations, gradients and all-reduces really move (gloo over loopback:
this script does not shape the network, and the cluster declares fast links so the model agrees).
The device kinds are slow on purpose (about 20 ms of forward per layer and sequence) so that
modelled compute dominates the interpreter's own time per action (a few ms on this machine), as GPU
compute dominates it on a GPU. Predicted: the planner's step time. Measured: the median step time
of ``hetero-launch --metrics-jsonl`` after the warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from scipy.stats import kendalltau

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchlib  # noqa: E402  (this folder)

from hetero_llm.planner import plan_cluster  # noqa: E402
from hetero_llm.planner.cluster import load_cluster  # noqa: E402
from hetero_llm.planner.output import layout_text  # noqa: E402

CLUSTER = """[model]
layers = 8
hidden = 32
heads = 4
vocab = 64
seq_len = 16
norm = "rmsnorm"
position = "rope"
mlp = "swiglu"

[train]
steps = {steps}
global_batch = 8
seed = 11
lr = 3e-3
log_every = 1

[data]
kind = "grammar"

[cluster]
[[cluster.domains]]
name = "fast"
kind = "ethernet"
bandwidth_gbps = 10
latency_us = 20
[[cluster.domains]]
name = "slow"
kind = "ethernet"
bandwidth_gbps = 10
latency_us = 20
[[cluster.nodes]]
name = "f0"
devices = ["cpu", "cpu"]
domain = "fast"
[[cluster.nodes]]
name = "s0"
domain = "slow"
[[cluster.nodes]]
name = "s1"
domain = "slow"

[plan]
max_tp = 2
[plan.nodes]
f0 = "emu-fast"
"s*" = "emu-slow"
[plan.kinds.emu-fast]   # about 20 ms of forward per layer and sequence (--quick: 5 ms)
tflops = {fast_tflops:g}
memory_gb = 8
link_gbps = 10
mem_bw_gbs = 10
[plan.kinds.emu-slow]   # half as fast
tflops = {slow_tflops:g}
memory_gb = 8
link_gbps = 10
mem_bw_gbs = 10
"""


def cluster_text(steps: int, speed: float = 1.0) -> str:
    """The emulated cluster file; ``speed`` multiplies both device kinds' FLOPS (``--quick``: 4)."""
    return CLUSTER.format(steps=steps, fast_tflops=0.000025 * speed, slow_tflops=0.0000125 * speed)


def emulation_env(cluster, cand) -> str:
    """HETERO_EMULATE_ACTION_S for a candidate: per rank, its stage's modelled action durations."""
    from hetero_llm.planner.cost import CostModelPlanner
    cost = CostModelPlanner(cluster)
    items, rank = [], 0
    for p in cand.pipelines:
        for i, s in enumerate(p.stages):
            f, b, w, _ = cost.stage_times(s.group, s.layers, i == len(p.stages) - 1, p.rows, s.recompute)
            c = cand.chunks if cand.schedule == "interleaved" and len(p.stages) > 1 else 1
            spec = f"F={f / c:.6f};B={b / c:.6f};I={(b - w) / c:.6f};W={w / c:.6f}"
            for _ in s.group.devices:
                items.append(f"{rank}:{spec}")
                rank += 1
    return ",".join(items)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--plans", type=int, default=10)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    speed = 1.0
    if args.quick:  # the measured step stays above the modelled one at any speed: the emulated actions are a floor
        args.plans, args.steps, args.warmup, speed = 2, 2, 1, 4.0
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "cluster.toml").write_text(cluster_text(args.steps, speed))
        cluster = load_cluster(tmp / "cluster.toml")
        # the pick and lower-ranked plans spread over the ranking (neighbours in it differ by noise only)
        ranked = plan_cluster(cluster, top=6 * args.plans).ranked
        stride = max(1, len(ranked) // args.plans)
        chosen = [(i, ranked[i]) for i in range(0, len(ranked), stride)][:args.plans]
        for i, (cand, score) in chosen:
            path = tmp / f"plan{i}.toml"
            path.write_text(layout_text(cluster, cand, score, None))
            env = benchlib.clean_env({"HETERO_EMULATE_ACTION_S": emulation_env(cluster, cand)})
            steps = benchlib.run_layout(path, tmp / f"run{i}", env=env)
            measured = statistics.median(r["seconds"] for r in steps[args.warmup:])
            shape = " / ".join("+".join(f"{s.layers}L/tp{s.group.tp}" for s in p.stages) for p in cand.pipelines)
            rows.append({"rank": i + 1, "schedule": cand.schedule, "pipelines": shape, "rows": cand.pipelines[0].rows,
                         "predicted_s": score.step_time, "measured_s": measured})
            benchlib.say(f"plan #{i + 1} ({cand.schedule}, {shape}): predicted {score.step_time:.4f} s, "
                         f"measured {measured:.4f} s")
    errors = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows]
    tau = kendalltau([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]).statistic if len(rows) > 1 else 1.0
    best = min(r["measured_s"] for r in rows)
    summary = {"plans": len(rows), "mean_error": statistics.mean(errors), "max_error": max(errors),
               "kendall_tau": tau, "pick_vs_best_measured": rows[0]["measured_s"] / best}
    lines = ["| # | schedule | pipelines (layers/TP per stage) | rows/mb | predicted s | measured s | error |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['rank']} | {r['schedule']} | {r['pipelines']} | {r['rows']} | {r['predicted_s']:.4f} | "
              f"{r['measured_s']:.4f} | {e:+.1%} |".replace("+-", "-") for r, e in
              zip(rows, [(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows])]
    lines += ["", f"mean |error| {summary['mean_error']:.1%} (max {summary['max_error']:.1%}), Kendall tau "
              f"{tau:.2f}, the planner's pick is {summary['pick_vs_best_measured']:.3f}x the best measured step"]
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "plan_vs_measured.json").write_text(json.dumps({"rows": rows, "summary": summary,
                                                           "command": " ".join(sys.argv)}, indent=1))
    (out / "plan_vs_measured.md").write_text(text)


if __name__ == "__main__":
    main()
