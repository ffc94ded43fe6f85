"""Criterion 5a of issue 36: ``hetero-plan --buckets``' predicted gain over the best static layout in HotSPa's
regime, beside what HotSPa published for the same cases.

    python -m bench.planner.plan_buckets_hotspa                  # the 20 cases below
    python -m bench.planner.plan_buckets_hotspa --cases 7b-8-32k-lognormal --tag one

Each case is a cluster file written from ``layouts/clusters/llama7b_32k.toml``'s (DGX A100-80G nodes of 8 over
NVLink, eight 200 Gbit/s HDR InfiniBand NICs a node, NCCL, bf16, ZeRO-1 among the optimizers, ``plan.max_cp = 8``)
with the case's model (Llama-2 7B or 13B shapes), GPU count (8, 16, 32: one to four nodes), row length (16K,
32K, 64K) and length mixture, about 2M tokens a step (``train.global_batch`` = 2^21 / seq_len rows; HotSPa's
scripts use 512 sequences), and HotSPa's bucket bounds for that length (``BOUNDS``). Two mixtures, both as the
runtime's grammar documents and ``[plan.documents]``:

- **lognormal**: median 2048 tokens, sigma 1.6 (the project's long-tailed corpus, llama7b_32k.toml);
- **github-like**: median 1024, sigma 2.2, a heavier tail (code files: many short, a few very long; HotSPa's
  GitHub set is StarCoder's, whose exact lengths are not in this repository).

For each case: the best static plan with CP (``plan_cluster``, the baseline ``--buckets`` prices against), the best
without CP (``plan.max_cp = 1``, the baseline before issue 36), then ``propose`` and ``judge`` as ``hetero-plan
--buckets`` runs them. ``--whole-rows``: attention priced over the whole packed row (``S^2``, no
``[plan.documents]``), as HotSPa's flash attention runs a packed row (no document mask). Planner only: nothing is run, nothing timed. Results: bench/results/plan_buckets_hotspa.{json,md}.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import attrs

from bench.common import benchlib
from hetero_llm.errors import LayoutError
from hetero_llm.planner import load_cluster, plan_cluster, planned_cluster
from hetero_llm.switching import propose, worth

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "layouts" / "clusters" / "llama7b_32k.toml"
TOKENS = 2**21  # tokens a step (rows x seq_len)

MODELS = {  # Llama-2 shapes
    "7b": dict(layers=32, hidden=4096, heads=32, ffn=11008),
    "13b": dict(layers=40, hidden=5120, heads=40, ffn=13824),
}
MIXTURES = {"lognormal": (2048, 1.6), "github-like": (1024, 2.2)}
BOUNDS = {16384: "4096,8192", 32768: "4096,16384", 65536: "4096,16384,32768"}  # HotSPa's BUCKET_SIZES per length
# HotSPa's published strategies (dp,tp,pp) per case, from its artifact's scripts (HotSPa-AE README, 16K buckets
# (16384 8192 4096 0) on CommonCrawl / the GitHub set's four): the longest bucket's first
HOTSPA = {
    ("7b", 8): "CommonCrawl 1,4,2 / 2,2,2 / 8,1,1; GitHub 1,4,2 / 2,2,2 / 4,2,1 / 8,1,1",
    ("7b", 16): "CommonCrawl 2,4,2 / 4,4,1 / 16,1,1; GitHub 2,4,2 / 4,4,1 / 8,2,1 / 16,1,1",
    ("13b", 8): "CommonCrawl 1,8,1 / 1,4,2 / 4,2,1; GitHub 1,8,1 / 1,4,2 / 2,2,2 / 4,2,1",
    ("13b", 16): "CommonCrawl 2,8,1 / 4,4,1 / 8,2,1; GitHub 2,8,1 / 4,4,1 / 4,2,2 / 8,2,1",
}
CASES = [f"{m}-{g}-32k-{x}" for m in MODELS for g in (8, 16, 32) for x in MIXTURES] + [
    f"{m}-16-{s}-{x}" for m in MODELS for s in ("16k", "64k") for x in MIXTURES
]


def cluster_text(model: str, gpus: int, seq_len: int, mixture: str, whole_rows: bool = False) -> str:
    """The case's cluster file (module doc); ``whole_rows``: attention priced over the whole packed row (``S^2``,
    no ``[plan.documents]``), as HotSPa's kernel runs it."""
    text = BASE.read_text()
    head, _, rest = text.partition("[model]")
    shapes = MODELS[model]
    for key in ("layers", "hidden", "heads", "ffn"):
        default = {"layers": 32, "hidden": 4096, "heads": 32, "ffn": 11008}[key]
        rest = rest.replace(f"\n{key} = {default}\n", f"\n{key} = {shapes[key]}\n", 1)
    rest = rest.replace("seq_len = 32768", f"seq_len = {seq_len}").replace(
        "global_batch = 64", f"global_batch = {TOKENS // seq_len}"
    )
    median, sigma = MIXTURES[mixture]
    rest = rest.replace(
        "doc_len_median = 2048\ndoc_len_sigma = 1.6", f"doc_len_median = {median}\ndoc_len_sigma = {sigma}"
    )
    rest = rest.replace("median = 2048\nsigma = 1.6", f"median = {median}\nsigma = {sigma}")
    body, _, plan = rest.partition("\n[plan]\n")
    nodes = body.split("[[cluster.nodes]]")
    rest = "[[cluster.nodes]]".join(nodes[: 1 + gpus // 8]).rstrip("\n") + "\n\n[plan]\n" + plan
    if whole_rows:
        rest = rest.partition("[plan.documents]")[0]
    return "[model]" + rest


def summary(cand) -> str:
    """'2x(PP 2: TP 2 CP 2 / TP 2 CP 2)': the pipelines of a plan, grouped (no '|': a table cell)."""
    shapes: dict[str, int] = {}
    for p in cand.pipelines:
        stages = " / ".join(
            f"TP {s.group.tp}" + (f" CP {s.group.cp}" if s.group.cp > 1 else "") + ("" if not s.recompute else " rc")
            for s in p.stages
        )
        key = f"PP {len(p.stages)}: {stages}" if len(p.stages) > 1 else stages
        shapes[key] = shapes.get(key, 0) + 1
    return ", ".join(f"{n}x({k})" if n > 1 else f"({k})" for k, n in shapes.items())


def measure(case: str, folder: Path, whole_rows: bool = False) -> dict:
    model, gpus_s, length, mixture = case.split("-", 3)
    gpus, seq_len = int(gpus_s), int(length[:-1]) * 1024
    path = folder / f"{case}.toml"
    path.write_text(cluster_text(model, gpus, seq_len, mixture, whole_rows))
    c = load_cluster(path)
    t0 = time.process_time()
    out: dict = {"case": case, "model": model, "gpus": gpus, "seq_len": seq_len, "mixture": mixture}
    out["bounds"] = BOUNDS[seq_len]
    try:
        static = plan_cluster(c, top=1)
    except LayoutError as e:
        return {**out, "error": str(e).split(": ", 1)[-1][:160]}
    no_cp = plan_cluster(attrs.evolve(c, limits=attrs.evolve(c.limits, max_cp=1)), top=1)
    c = planned_cluster(c, static.best)
    bounds = propose.parse_bounds(BOUNDS[seq_len], c)
    proposed = propose.propose(c, bounds, static.best)
    verdict = worth.judge(c, static.best, static.score, proposed)
    kept = verdict.chosen
    out.update(
        static_s=static.score.step_time,
        static=summary(static.best),
        no_cp_s=no_cp.score.step_time,
        demand=list(propose.demand(c, bounds)),
        proposed_s=verdict.proposed.step_s,
        proposed_over=verdict.proposed.over,
        kept_s=kept.step_s,
        kept_switch_s=kept.switch_s,
        gain=verdict.static_s / kept.step_s,
        gain_vs_no_cp=no_cp.score.step_time / kept.step_s,
        switching=verdict.switching,
        buckets=[
            {"max_len": b.max_len, "plan": summary(b.plan) if b.plan is not None else "home", "why": b.why_home}
            for b in kept.buckets
        ],
        written=[b.max_len for b in verdict.buckets if b.plan is not None],
        cpu_s=time.process_time() - t0,
    )
    return out


def report(rows: list[dict], info: dict) -> str:
    lines = benchlib.report_head(
        "hetero-plan --buckets in HotSPa's regime (issue 36, criterion 5a)",
        info["machine"],
        info["load_before"],
        info["load_after"],
    ) + [
        ("Attention over the WHOLE packed row (S^2 a row, HotSPa's kernel). " if info["whole_rows"] else "")
        + f"{info['cpu_s']:.0f} s of CPU. PREDICTED by the planner's cost model; nothing run. Gain = best static step "
        "(CP allowed) / the step of the best set of buckets the descent found (below 1: the static layout is "
        "written; 'written' names the buckets with their own layouts where they pay).",
        "",
        "| case | buckets | best static (CP) s | its layout | static without CP s | rows per bucket | buckets kept s | "
        "switches s | gain vs static | vs static without CP | best buckets' layouts | written |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['bounds']} | nothing fits: {r['error']} | | | | | | | | | |")
            continue
        kept = "; ".join(f"{b['max_len']}: {b['plan']}" for b in r["buckets"])
        written = ", ".join(map(str, r["written"])) or "static"
        lines.append(
            f"| {r['case']} | {r['bounds']} | {r['static_s']:.4g} | {r['static']} | {r['no_cp_s']:.4g} | "
            f"{'/'.join(map(str, r['demand']))} | {r['kept_s']:.4g} | {r['kept_switch_s']:.3g} | {r['gain']:.3f} | "
            f"{r['gain_vs_no_cp']:.3f} | {kept} | {written} |"
        )
    lines += ["", "HotSPa's published strategies (dp,tp,pp per bucket, longest first) for the same model and GPUs:", ""]
    lines += [f"- {m} on {g} GPUs: {s}" for (m, g), s in HOTSPA.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated MODEL-GPUS-LENGTH-MIXTURE")
    ap.add_argument(
        "--whole-rows",
        action="store_true",
        help="price attention over the whole packed row (S^2, as HotSPa's flash attention without document masks)",
    )
    ap.add_argument("--tag", default="", help="results as plan_buckets_hotspa_TAG.{json,md}")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    load_before = benchlib.load_average()
    t0 = time.process_time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="plan_buckets_") as folder:
        for case in args.cases.split(","):
            rows.append(measure(case, Path(folder), args.whole_rows))
            r = rows[-1]
            benchlib.say(f"{case}: " + (r["error"] if "error" in r else f"gain {r['gain']:.3f} ({r['cpu_s']:.0f} s)"))
    info = {
        "whole_rows": args.whole_rows,
        "command": benchlib.command_line(),
        "machine": benchlib.machine(),
        "load_before": load_before,
        "load_after": benchlib.load_average(),
        "cpu_s": time.process_time() - t0,
    }
    text = report(rows, info)
    print(text)
    name = "plan_buckets_hotspa" + (f"_{args.tag}" if args.tag else "")
    benchlib.write_results(Path(args.out_dir), name, text, {**info, "results": rows})


if __name__ == "__main__":
    main()
