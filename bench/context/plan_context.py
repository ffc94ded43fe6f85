"""Long sequences in the planner: attention priced per row vs per document, and the best plan with context
parallelism in the search vs without (issue 35). Torch-free; planner only (no run).

    python -m bench.context.plan_context [CLUSTER.toml] [--json FILE]

For the cluster file (default layouts/clusters/llama7b_32k.toml: Llama-7B shapes, 4 x 8 A100-80G, NVLink +
InfiniBand, a lognormal corpus) at its sequence length and at twice it (half the sequences per step: the same
tokens), four searches: one document per row (S^2 per row, today's pricing) and per document, each with
``plan.max_cp`` = 1 and the file's; and the per-row plan priced per document (what the per-row pricing
overstates), with the file's corpus and with shorter documents. Prints a table and, with --json, writes the rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import attrs

from hetero_llm._fs import write_atomically
from hetero_llm.planner import plan_cluster, with_optimizer
from hetero_llm.planner.candidates import Candidate
from hetero_llm.planner.cluster import Cluster, load_cluster
from hetero_llm.planner.cost import PlannerCostModel
from hetero_llm.planner.documents import Documents
from hetero_llm.planner.output import summary

DEFAULT = Path(__file__).resolve().parents[2] / "layouts" / "clusters" / "llama7b_32k.toml"


def variant(cluster: Cluster, seq_len: int, per_document: bool, max_cp: int) -> Cluster:
    """``cluster`` at ``seq_len`` (the step's tokens kept), priced per row or per its documents, with ``max_cp``."""
    scale = seq_len / cluster.model.seq_len
    batch = max(1, round(cluster.train.global_batch / scale))
    return attrs.evolve(
        cluster,
        model=attrs.evolve(cluster.model, seq_len=seq_len),
        train=attrs.evolve(cluster.train, global_batch=batch),
        limits=attrs.evolve(cluster.limits, max_cp=max_cp),
        documents=cluster.documents if per_document else Documents(),
    )


def shape(cand: Candidate) -> str:
    """The plan in a line: its summary, then each distinct stage shape (TP x CP, layers, recompute) and the rows."""
    stages = sorted(
        {
            f"TP{s.group.tp}" + (f"xCP{s.group.cp}" if s.group.cp > 1 else "") + ("+rc" if s.recompute else "")
            for p in cand.pipelines
            for s in p.stages
        }
    )
    return f"{summary(cand)}; {'/'.join(stages)}; {cand.pipelines[0].rows} rows per microbatch"


def rows(cluster: Cluster) -> list[dict]:
    out = []
    for seq_len in (cluster.model.seq_len, 2 * cluster.model.seq_len):
        plans = {}
        for per_document in (False, True):
            for max_cp in sorted({1, cluster.limits.max_cp}):
                c = variant(cluster, seq_len, per_document, max_cp)
                res = plan_cluster(c, top=1)
                plans[per_document, max_cp] = (c, res)
                out.append(
                    {
                        "seq_len": seq_len,
                        "global_batch": c.train.global_batch,
                        "pricing": "per document" if per_document else "per row",
                        "max_cp": max_cp,
                        "step_s": res.score.step_time,
                        "plan": shape(res.best),
                        "cp": sorted({s.group.cp for p in res.best.pipelines for s in p.stages}),
                        "square_over_s2": PlannerCostModel(c).square / seq_len**2,
                    }
                )
        # the per-row plan (no CP) priced per document: what per-row pricing overstates on the plan it picks (with
        # the plan's optimizer); and with a corpus of shorter documents (median 512 tokens, sigma 1)
        row_plan = plans[False, 1][1].best
        c_doc = with_optimizer(plans[True, 1][0], row_plan.optimizer)
        short = attrs.evolve(c_doc, documents=Documents("lognormal", median=512.0, sigma=1.0))
        for c, corpus in ((c_doc, ""), (short, " (median 512, sigma 1)")):
            cost = PlannerCostModel(c)
            out.append(
                {
                    "seq_len": seq_len,
                    "global_batch": c.train.global_batch,
                    "pricing": f"per-row plan, priced per document{corpus}",
                    "max_cp": 1,
                    "step_s": cost.score(row_plan).step_time,
                    "plan": shape(row_plan),
                    "cp": [1],
                    "square_over_s2": cost.square / seq_len**2,
                }
            )
    return out


def table(out: list[dict]) -> str:
    lines = [
        "| seq_len | batch | pricing | max_cp | step s | Q / S^2 | plan |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in out:
        lines.append(
            f"| {r['seq_len']} | {r['global_batch']} | {r['pricing']} | {r['max_cp']} | {r['step_s']:.4g} | "
            f"{r['square_over_s2']:.3f} | {r['plan']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cluster", nargs="?", default=str(DEFAULT))
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    out = rows(load_cluster(args.cluster))
    print(table(out))
    if args.json:
        text = (json.dumps(out, indent=1) + "\n").encode()
        write_atomically(Path(args.json), lambda f: f.write(text))


if __name__ == "__main__":
    main()
