"""The planner's prediction for each single-stage run of a GPU benchmark, against what that run measured.

``bench/gpu/gpu_bench.py`` measures our runtime (``impl = ours``) training one stage on one GPU, with a known batch
and one microbatch, eager or with ``train.compile = "blocks"``. This script writes the same layout and a
cluster file naming the GPU's catalogue kind (``--kind``; ``h200-sxm`` for an H200), asks ``hetero-plan
--evaluate`` for its step time (``plan.execution`` = eager for eager runs, compiled for compiled ones) and
prints predicted / measured. Torch-free: it reads the benchmark's JSON.

    python -m bench.gpu.gpu_predict bench/results/gpu_bench_h200.json --kind h200-sxm
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import click

from bench.common import benchlib
from bench.gpu.gpu_bench_cases import SIZES, Case, layout_toml
from hetero_llm import layout as layout_mod
from hetero_llm.planner import evaluate, load_cluster


def cluster_toml(layout_text: str, kind: str, execution: str) -> str:
    """The layout's sections less its pipelines, with a [plan] naming the node's kind and the execution."""
    kept = layout_text.split("[[pipelines]]", 1)[0].rstrip() + "\n"
    return kept + f'\n[plan]\nexecution = "{execution}"\n[plan.nodes]\nr0 = "{kind}"\n'


def predict(row: dict, kind: str, workdir: Path) -> float:
    """Predicted seconds per step for one single-stage row of gpu_bench's JSON."""
    case = Case(SIZES[row["model"]], row["seq"], row["batch"])
    mode = row["mode"]
    text = layout_toml(
        case,
        devices=["cuda:0"],
        steps=10,
        corpus=workdir / "corpus.txt",
        compile_mode="blocks" if mode == "compiled" else "none",
    )
    name = f"{row['model']}_{row['seq']}_{mode}"
    lpath, cpath = workdir / f"{name}_layout.toml", workdir / f"{name}_cluster.toml"
    lpath.write_text(text)
    cpath.write_text(cluster_toml(text, kind, "compiled" if mode == "compiled" else "eager"))
    ev = evaluate.evaluate(load_cluster(str(cpath)), layout_mod.load(str(lpath)), str(lpath))
    return ev.score.step_time


@click.command()
@click.argument("results", type=click.Path(exists=True, dir_okay=False))
@click.option("--kind", default="h200-sxm", show_default=True, help="The GPU's kind in the planner's catalogue.")
def main(results, kind):
    """Predicted against measured step times of gpu_bench's single-stage runs of our runtime."""
    data = json.loads(Path(results).read_text())
    rows = [r for r in data["single_stage"] if r["impl"] == "ours"]
    out = []
    with tempfile.TemporaryDirectory(prefix="gpu_predict_") as tmp:
        # the layouts name a corpus: only its length is checked
        (Path(tmp) / "corpus.txt").write_bytes(bytes(range(256)) * 64)
        for r in rows:
            predicted = predict(r, kind, Path(tmp))
            measured = r["step_s"]
            out.append(
                [r["model"], r["seq"], r["batch"], r["mode"], measured * 1e3, predicted * 1e3, predicted / measured]
            )
    print(f"{data['device']['name']} (kind {kind}), torch {data['torch']}: our runtime, one stage, one microbatch\n")
    print(benchlib.markdown_table(["model", "seq", "batch", "mode", "measured ms", "predicted ms", "pred/meas"], out))


if __name__ == "__main__":
    sys.exit(main())
