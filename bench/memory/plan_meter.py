"""The planner's memory model against the tensor meter, for the planner's own picks on the repository's CPU clusters.

    python -m bench.memory.plan_meter            # layouts/clusters/small_cpu.toml and two_domains.toml
    python -m bench.memory.plan_meter --quick    # small_cpu.toml only (the test suite)

For each cluster file whose devices are CPU slots, the planner's pick (``plan_cluster``, its default work budget:
what ``hetero-plan CLUSTER -o LAYOUT`` writes) is trained for its ``train.steps`` with ``HETERO_TENSOR_METER`` set
(hetero_llm/runtime/tensor_meter.py: each rank counts its parameters, gradients, optimizer state, the tensors a split
backward puts off and autograd's saved tensors, after every compute action and at the step's checkpoints), and each
rank's measured peak is set beside the bytes the planner's memory model gives its stage (``Score.memory``, what it
checks against the device's memory). Not counted by the meter: the stage-boundary buffers and the data; transient
tensors inside one autograd node. A memory measurement, not a timing. Results: bench/results/plan_meter.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.common import benchlib
from hetero_llm import layout as layout_mod
from hetero_llm.plan import compile_plan
from hetero_llm.planner import load_cluster, plan_cluster
from hetero_llm.planner.output import layout_text
from hetero_llm.runtime.tensor_meter import ENV

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ("layouts/clusters/small_cpu.toml", "layouts/clusters/two_domains.toml")
WITHIN = 0.10  # the target: every rank's measured peak within 10% of the model


def measure(path: str, work: Path) -> list[dict]:
    cluster = load_cluster(ROOT / path)
    result = plan_cluster(cluster, top=1)
    layout = work / Path(path).name
    layout.write_text(layout_text(cluster, result.best, result.score, None))
    plan = compile_plan(layout_mod.load(layout))
    meter = work / (layout.stem + "_meter")
    meter.mkdir()
    benchlib.launch_layout(layout, work / layout.stem, env={ENV: str(meter)})
    rows = []
    for rank, info in enumerate(plan.ranks):
        got = json.loads((meter / f"rank{rank}.json").read_text())
        modelled = result.score.memory[info.pipeline][info.stage]
        rows.append(
            {
                "cluster": path,
                "pick": result.best.schedule + f", {result.best.optimizer}, {len(result.best.pipelines)} pipelines",
                "rank": rank,
                "pipeline": info.pipeline,
                "stage": info.stage,
                "modelled_bytes": modelled,
                "measured_bytes": got["peak_bytes"],
                "ratio": got["peak_bytes"] / modelled,
                "at_peak": got["at_peak"],
            }
        )
    return rows


def report(rows: list[dict], info: dict) -> str:
    within = sum(abs(r["ratio"] - 1) <= WITHIN for r in rows)
    lines = benchlib.report_head(
        "The memory model against the tensor meter (the planner's picks)",
        info["machine"],
        info["before"],
        info["after"],
    )
    lines += [
        f"{within} of {len(rows)} ranks within {WITHIN:.0%} of the model (measured / modelled "
        f"{min(r['ratio'] for r in rows):.3f}-{max(r['ratio'] for r in rows):.3f}).",
        "",
        benchlib.markdown_table(
            [
                "cluster",
                "pick",
                "rank (pipeline, stage)",
                "modelled KB",
                "measured KB",
                "measured / modelled",
                "at peak",
            ],
            [
                [
                    r["cluster"],
                    r["pick"],
                    f"{r['rank']} ({r['pipeline']}, {r['stage']})",
                    f"{r['modelled_bytes'] / 1e3:.1f}",
                    f"{r['measured_bytes'] / 1e3:.1f}",
                    f"{r['ratio']:.3f}",
                    ", ".join(f"{k} {v / 1e3:.1f}" for k, v in r["at_peak"].items()),
                ]
                for r in rows
            ],
        ),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small_cpu.toml only")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    before = benchlib.load_average()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="plan_meter.") as tmp:
        for path in CLUSTERS[:1] if args.quick else CLUSTERS:
            rows += measure(path, Path(tmp))
            benchlib.say(
                f"{path}: " + ", ".join(f"rank {r['rank']} {r['ratio']:.3f}" for r in rows if r["cluster"] == path)
            )
    info = {"command": benchlib.command_line(), "machine": benchlib.machine(), "before": before}
    info["after"] = benchlib.load_average()
    text = report(rows, info)
    print(text)
    benchlib.write_results(Path(args.out_dir), "plan_meter", text, {**info, "results": rows})


if __name__ == "__main__":
    main()
