"""What the planner's two sub-solvers leave out, measured: the layer split the search gives each pipeline
(``layers.py``'s front and pick, ``polish.py``) against every other split, and one microbatch size for every
pipeline against a size per pipeline.

    python -m bench.planner.plan_split_gap                  # 60 of bench/planner/plan_exhaustive.py's clusters + the CPU clusters
    python -m bench.planner.plan_split_gap --clusters 5     # fewer (the test suite runs --quick: 2)
    python -m bench.planner.plan_split_gap --clusters 0 --files layouts/clusters/hexiscale_40gpu.toml --tag papers

For each cluster the search's plan (``plan_cluster``, its default work budget) is priced again by the same cost model
with, pipeline by pipeline (the others as they are), every other choice of

- **split**: every contiguous layer split of the pipeline's stages (in multiples of the chunk count; where there are
  more than ``MAX_SPLITS``, every split one unit moved from one stage to another away), each stage recomputing only
  where it does not fit otherwise (the DP's rule), the microbatches as planned;
- **rows**: every microbatch size dividing the pipeline's batch (interleaved: microbatches a multiple of the stages),
  its layers split as the search splits them at that size (the front's pick);

kept where the predicted step is shorter, pipeline after pipeline until none improves. The result is a descent, not
an enumeration of every pipeline's choices at once: the gap it finds is a lower bound of the true gap. Nothing here
runs a model. Results: bench/results/plan_split_gap.{json,md} (or --out-dir).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from pathlib import Path

import attrs

from bench.common import benchlib
from bench.planner.plan_bench import load
from bench.planner.plan_exhaustive import draw
from hetero_llm.planner import load_cluster, plan_cluster, with_optimizer
from hetero_llm.planner.candidates import Candidate, PipelineChoice, StageChoice
from hetero_llm.planner.search import Planner
from hetero_llm.planner.structure import Structure

ROOT = Path(__file__).resolve().parents[2]
MAX_SPLITS = 20_000  # a pipeline with more contiguous splits than this tries one-unit moves between its stages
CPU_CLUSTERS = ("layouts/clusters/small_cpu.toml", "layouts/clusters/two_domains.toml")


def _structure(cand: Candidate) -> Structure:
    pipes = tuple(tuple(s.group for s in p.stages) for p in cand.pipelines)
    return Structure(pipes, cand.pipelines[0].rows, cand.schedule, cand.chunks)


def _kind(cand: Candidate, stages: int) -> tuple[str, int]:
    """The schedule and chunk count a pipeline of ``stages`` runs (a one-stage interleaved pipeline runs 1F1B)."""
    if cand.schedule == "interleaved" and stages == 1:
        return "1f1b", 1
    return cand.schedule, cand.chunks if cand.schedule == "interleaved" else 1


def splits(pl: Planner, cand: Candidate, i: int):
    """Pipeline ``i`` with every other contiguous layer split (the DP's recompute rule per stage)."""
    pipe = cand.pipelines[i]
    k = len(pipe.stages)
    schedule, chunks = _kind(cand, k)
    unit = chunks
    n = pl.L // unit
    peaks = pl.cost._peaks(schedule, k, pipe.microbatches, chunks)
    others = pl.zero1_others(_structure(cand))[i]
    if math.comb(n - 1, k - 1) <= MAX_SPLITS:
        every = (
            [(b - a) * unit for a, b in zip((0,) + cuts, cuts + (n,))]
            for cuts in itertools.combinations(range(1, n), k - 1)
        )
    else:  # too many: the splits one unit (chunks layers) moved from one stage to another away (the descent repeats)
        now = [s.layers for s in pipe.stages]
        every = (
            [x + unit * ((j == b) - (j == a)) for j, x in enumerate(now)]
            for a in range(k)
            for b in range(k)
            if a != b and now[a] > unit
        )
    for parts in every:
        stages = []
        for j, (s, layers) in enumerate(zip(pipe.stages, parts)):
            t, rc = pl.stage_cost(s.group, layers, j == 0, j == k - 1, pipe.rows, peaks[j], others)
            if t == float("inf"):
                break
            stages.append(StageChoice(s.group, layers, rc))
        else:
            yield attrs.evolve(pipe, stages=tuple(stages))


def rows(pl: Planner, cand: Candidate, i: int):
    """Pipeline ``i`` with every other microbatch size dividing its batch, its layers split as the search does."""
    pipe = cand.pipelines[i]
    groups = tuple(s.group for s in pipe.stages)
    schedule, chunks = _kind(cand, len(groups))
    others = pl.zero1_others(_structure(cand))[i]
    for r in range(1, pipe.batch + 1):
        m = pipe.batch // r
        if pipe.batch % r or r == pipe.rows or (schedule == "interleaved" and m % len(groups)):
            continue
        front, fills = pl.front_and_fills(groups, r, schedule, chunks, m, others)
        if front:  # the search's split at that size: its front's pick at m (layers.py)
            best = front[pl.pick(groups, front, fills, m, r, schedule, chunks)]
            yield PipelineChoice(pipe.batch, m, tuple(StageChoice(g, n, f) for g, n, f in zip(groups, *best[:2])))


def descend(pl: Planner, cand: Candidate, options) -> tuple[Candidate, float]:
    """Pipeline after pipeline, the best of ``options`` (a function of (planner, candidate, pipeline index)), until
    none shortens the predicted step."""
    best = pl.cost.score(cand).step_time
    improved = True
    while improved:
        improved = False
        for i in range(len(cand.pipelines)):
            for pipe in options(pl, cand, i):
                other = attrs.evolve(cand, pipelines=cand.pipelines[:i] + (pipe,) + cand.pipelines[i + 1 :])
                score = pl.cost.score(other)
                if score.feasible and score.step_time < best * (1 - 1e-12):
                    cand, best, improved = other, score.step_time, True
    return cand, best


def measure(name: str, cluster) -> dict:
    t0 = time.process_time()
    result = plan_cluster(cluster, top=1)
    pl = Planner(with_optimizer(cluster, result.best.optimizer or cluster.train.optimizer.value))
    planned = pl.cost.score(result.best).step_time
    by_split, split_step = descend(pl, result.best, splits)
    by_rows, rows_step = descend(pl, result.best, rows)
    return {
        "cluster": name,
        "planned_step_s": planned,
        "split_step_s": split_step,
        "split_gap": planned / split_step,
        "planned_splits": [[s.layers for s in p.stages] for p in result.best.pipelines],
        "better_splits": [[s.layers for s in p.stages] for p in by_split.pipelines],
        "rows_step_s": rows_step,
        "rows_gap": planned / rows_step,
        "planned_rows": [p.rows for p in result.best.pipelines],
        "better_rows": [p.rows for p in by_rows.pipelines],
        "cpu_s": time.process_time() - t0,
    }


def report(rows_: list[dict], info: dict) -> str:
    def summary(key: str) -> str:
        gaps = sorted(r[key] for r in rows_)
        over = [r for r in rows_ if r[key] > 1 + 1e-9]
        worst = max(rows_, key=lambda r: r[key])
        return (
            f"{len(over)} of {len(rows_)} plans improved; largest gap {gaps[-1]:.4f}x ({worst['cluster']}), "
            f"median {gaps[len(gaps) // 2]:.4f}x"
        )

    lines = benchlib.report_head(
        "What the planner's sub-solvers leave out", info["machine"], info["load_before"], info["load_after"]
    ) + [
        f"{info['cpu_s']:.0f} s of CPU.",
        "",
        "Gap = the plan's predicted step / the step after the descent (>= 1; 1: nothing better found).",
        "",
        f"- **Layer split minimising the step** (instead of the slowest stage): {summary('split_gap')}.",
        f"- **A microbatch size per pipeline** (instead of one for all): {summary('rows_gap')}.",
        "",
        "| cluster | planned step s | split gap | planned -> better split | rows gap | planned -> better rows |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows_:
        if r["split_gap"] > 1 + 1e-9 or r["rows_gap"] > 1 + 1e-9:
            lines.append(
                f"| {r['cluster']} | {r['planned_step_s']:.4g} | {r['split_gap']:.4f} | {r['planned_splits']} -> "
                f"{r['better_splits']} | {r['rows_gap']:.4f} | {r['planned_rows']} -> {r['better_rows']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", type=int, default=60, help="how many of bench/planner/plan_exhaustive.py's clusters")
    ap.add_argument("--quick", action="store_true", help="2 generated clusters and the CPU clusters (the test suite)")
    ap.add_argument(
        "--files", nargs="*", default=list(CPU_CLUSTERS), help="cluster files (relative to the repository root)"
    )
    ap.add_argument("--tag", default="", help="results as plan_split_gap_TAG.{json,md}")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    count = 2 if args.quick else args.clusters
    load_before = benchlib.load_average()
    t0 = time.process_time()
    out = [measure(path, load_cluster(ROOT / path)) for path in args.files]
    for seed in range(1, count + 1):
        out.append(measure(f"plan_exhaustive {seed}", load(draw(seed))))
        benchlib.say(f"cluster {seed}: split gap {out[-1]['split_gap']:.4f}, rows gap {out[-1]['rows_gap']:.4f}")
    info = {
        "command": benchlib.command_line(),
        "machine": benchlib.machine(),
        "load_before": load_before,
        "load_after": benchlib.load_average(),
        "cpu_s": time.process_time() - t0,
    }
    text = report(out, info)
    print(text)
    name = "plan_split_gap" + (f"_{args.tag}" if args.tag else "")
    benchlib.write_results(Path(args.out_dir), name, text, {**info, "results": out})


if __name__ == "__main__":
    main()
