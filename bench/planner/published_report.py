"""What bench/planner/published.py prints and writes: its tables of published against predicted, as Markdown."""

from __future__ import annotations

from bench.common import benchlib
from bench.planner.published_rows import LARGE


def summary(cand) -> str:
    from hetero_llm.planner.output import summary as plan_summary

    tp = "/".join(sorted({str(s.group.tp) for p in cand.pipelines for s in p.stages}, key=int))
    rc = sum(s.recompute for p in cand.pipelines for s in p.stages)
    stages = sum(len(p.stages) for p in cand.pipelines)
    return f"{plan_summary(cand)}, TP {tp}, rows/mb {cand.pipelines[0].rows}, recompute {rc}/{stages} stages"


ROW_COLUMNS = ["row", "GPUs", "metric", "published", "predicted", "predicted/published", "within 15%"]


WHAT_IF_COLUMNS = [
    "row",
    "predicted",
    "sync hidden",
    "uncalibrated",
    "step s",
    "bubble",
    "TP s",
    "sync s",
    "optimizer s",
]


DETAIL_COLUMNS = ["layout", "fullest stage GB", "of usable GB", "load s"]


PICK_COLUMNS = [
    "cluster",
    "published layout",
    "its step s",
    "pick's step s",
    "pick/published",
    "planner's pick",
    "plan s",
]


def num(v, digits: int = 4) -> str:
    return "n/a" if v is None else f"{v:.{digits}g}"


def report(rows: list[dict], picks: list[dict], info: dict) -> str:
    table = benchlib.markdown_table(
        ROW_COLUMNS,
        [
            [
                r["row"],
                str(r["gpus"]),
                r["metric"],
                num(r["published"]),
                num(r["predicted"]) + ("" if r["fits"] else " (does not fit)"),
                f"{r['ratio']:.2f}",
                "yes" if r["within_15pct"] else "no",
            ]
            for r in rows
        ],
    )
    what_if = benchlib.markdown_table(
        WHAT_IF_COLUMNS,
        [
            [
                r["row"],
                num(r["predicted"]),
                num(r["predicted_sync_hidden"]),
                num(r["predicted_uncalibrated"]),
                num(r["step_time_s"]),
                f"{r['bubble']:.1%}",
                num(r["tp_s"], 3),
                num(r["sync_s"], 3),
                num(r["optimizer_s"], 3),
            ]
            for r in rows
        ],
    )
    layouts: dict[str, dict] = {}
    for r in rows:
        layouts.setdefault(r["layout"], r)
    detail = benchlib.markdown_table(
        DETAIL_COLUMNS,
        [
            [
                name,
                num(r["memory_gb"], 3),
                num(r["usable_memory_gb"], 3),
                f"{r['load_cluster_s']:.2f} + {r['load_layout_s']:.2f}",
            ]
            for name, r in layouts.items()
        ],
    )
    pick_table = benchlib.markdown_table(
        PICK_COLUMNS,
        [
            [
                p["cluster"],
                p["layout"],
                num(p["published_layout_step_s"]),
                num(p["pick_step_s"]),
                num(p["pick_over_published"], 3),
                p["pick"],
                f"{p['plan_s']:.1f}",
            ]
            for p in picks
        ],
    )
    return "\n".join(
        [
            "# Cost model vs published measurements",
            "",
            f"Command: `{info['command']}`: {info['seconds']:.0f} s on {benchlib.machine_line(info['machine'])};",
            f"{benchlib.load_line(info['load_before'], info['load_after'])}. Planner budget {info['budget']:g} s per "
            f"cluster ({info['budget_large']:g} s above {LARGE} GPUs).",
            "",
            "Predicted: the cost model's step time for the published layout (`hetero-plan CLUSTER --evaluate LAYOUT`),",
            "converted to the publication's own FLOP counting. Nothing is measured on this machine. Megatron 1.7B",
            "is the calibration row of the GPUs' sustained fraction (hetero_llm/planner/catalogue.py): it matches",
            "by construction and checks nothing.",
            "",
            table,
            "",
            "What the predictions are made of. *sync hidden*: the same prediction with the gradient sync fully",
            "overlapped (step - sync); *uncalibrated*: without the catalogue's one calibrated constant (the",
            "GPUs' sustained fraction, calibrated on Megatron 1.7B; n/a: no kind here has one); *sync s*: the all-reduce",
            "time the step waits for (with plan.grad_overlap, what the last backward does not hide); step s is the",
            "predicted step (for a layout that does not fit in memory, what it would take if it did).",
            "",
            what_if,
            "",
            "Memory per device of each published layout's fullest stage (against its memory) as the cost model",
            "counts it, and the seconds to load the cluster file + the layout:",
            "",
            detail,
            "",
            "The planner's own pick on each cluster (`plan_cluster`), against the published layout's prediction:",
            "",
            pick_table,
            "",
        ]
    )
