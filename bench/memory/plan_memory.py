"""The planner's memory model against measured peaks: one pipeline of 2 stages (2 computing ranks, gloo on
CPU) under 1F1B, GPipe, interleaved 1F1B and ZB-H1.

    python -m bench.memory.plan_memory [--quick] [--out-dir bench/results]

For each schedule the same training runs (one fresh Python process per rank, ``benchlib.start_ranks``);
each rank reports its resident memory before training (``VmRSS`` after imports) and its peak
(``VmHWM``) and after training has returned (``VmRSS``). **Measured** = peak - after: what training
held at its peak and released (parameters, gradients, AdamW moments, activations in flight); what stays
resident after training (the data set, lazily loaded libraries, gloo's buffers: 17-50 MiB here) is not
training state and is not counted (``peak - before`` is reported beside it). glibc's mmap threshold is
fixed (``MALLOC_MMAP_THRESHOLD_``) so freed tensors leave the resident set. **Predicted** = the planner's ``PlannerCostModel.memory``
for the same candidate (stages, layers, microbatches, schedule): the bytes it checks against a device's
memory. Two computing ranks at most, so nothing here contends for more than the machine's 2 cores; a
memory measurement, not a timing.

Writes ``plan_memory.md`` / ``plan_memory.json`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import attrs

from bench.common import benchlib
from hetero_llm import layout as L

SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zbh1", 1)]
MIB = 2**20
# glibc serves allocations above a threshold with mmap and returns them to the OS when freed; by default
# the threshold grows to the largest block freed so far, after which freed tensors stay in the heap and in
# the resident set. A fixed threshold keeps the resident set close to the live tensors.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def cluster_sections(hidden: int, ffn: int, layers: int, seq: int, batch: int, steps: int) -> dict[str, Any]:
    """The cluster file's sections: a Llama-style model, one node of two CPU devices."""
    model = L.ModelSpec(
        layers=layers,
        hidden=hidden,
        heads=8,
        ffn=ffn,
        vocab=256,
        seq_len=seq,
        norm=L.Norm.RMSNORM,
        position=L.Position.ROPE,
        mlp=L.Mlp.SWIGLU,
    )
    cluster = L.ClusterSpec(nodes=(L.NodeSpec(name="n0", devices=("cpu", "cpu")),), timeout_s=300.0)
    return {
        "model": model,
        "train": L.TrainSpec(steps=steps, global_batch=batch, log_every=1),
        "data": L.DataSpec(),
        "cluster": cluster,
    }


def schedule_layout(
    sections: dict[str, Any], file: str, schedule: str, chunks: int, layers: int, batch: int
) -> L.Layout:
    """The cluster under ``schedule``: one pipeline of two stages, one microbatch per sequence."""
    train = attrs.evolve(sections["train"], schedule=L.Schedule(schedule), chunks=chunks)
    half = layers // 2
    stages = (L.StageSpec(layers=half, devices=("n0:0",)), L.StageSpec(layers=layers - half, devices=("n0:1",)))
    return L.Layout(
        file=file,
        **{**sections, "train": train},
        pipelines=(L.PipelineSpec(batch=batch, microbatches=batch, stages=stages),),
    )


def predicted(cluster_path: Path, schedule: str, chunks: int, layers: int, batch: int) -> list[float]:
    """The planner's bytes per device of the two stages."""
    from hetero_llm.planner.candidates import Candidate, PipelineChoice, StageChoice, TPGroup
    from hetero_llm.planner.cluster import load_cluster
    from hetero_llm.planner.cost import PlannerCostModel

    c = load_cluster(cluster_path)
    cost = PlannerCostModel(c)
    kind = c.node("n0").kind
    groups = [TPGroup("n0", c.nodes[0].domain, (f"n0:{i}",), kind) for i in range(2)]
    half = layers // 2
    cand = Candidate(
        (PipelineChoice(batch, batch, (StageChoice(groups[0], half), StageChoice(groups[1], layers - half))),),
        schedule,
        chunks,
    )
    mems, _ = cost.memory(cand)
    return list(mems[0])


def child(out: str, argv: list[str]) -> None:
    """One rank: run ``hetero-launch ARGV`` and write its resident memory before and at the peak."""
    import torch

    from bench.memory.zero1_memory import status_bytes
    from hetero_llm.cli import launch
    from hetero_llm.train import loop  # noqa: F401  (imported before the baseline is read)

    rank = int(argv[argv.index("--rank") + 1])
    x = torch.randn(64, 64, requires_grad=True)  # torch's thread pool and kernels: loaded before the baseline
    (x @ x).sum().backward()
    before = status_bytes("VmRSS")
    launch.main(argv, standalone_mode=False)
    (Path(out) / f"rank{rank}.json").write_text(
        json.dumps(
            {"rank": rank, "rss_before": before, "peak_rss": status_bytes("VmHWM"), "rss_after": status_bytes("VmRSS")}
        )
    )


def run(layout: Path, out: Path) -> list[dict]:
    out.mkdir()
    for attempt in range(3):  # a free port can be taken by another program before rank 0 listens on it
        try:
            benchlib.start_ranks(
                "bench.memory.plan_memory",
                ["--child", str(out), "--", str(layout), "--quiet", "--set", f"cluster.port={benchlib.free_port()}"],
                2,
                env=MALLOC_ENV,
            )
            break
        except RuntimeError as e:
            if "address already in use" not in str(e) or attempt == 2:
                raise
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and one step (checks the script)")
    parser.add_argument("--out-dir", type=Path, default=benchlib.RESULTS)
    args = benchlib.rank_script_args(parser, child)
    if args is None:  # this process was one rank (--child)
        return
    hidden, ffn, layers, seq, batch, steps = (64, 160, 4, 32, 4, 1) if args.quick else (512, 1376, 4, 128, 8, 2)
    load_before = benchlib.load_average()
    results = []
    with tempfile.TemporaryDirectory(prefix="hl_planmem_") as tmp:
        cluster = cluster_sections(hidden, ffn, layers, seq, batch, steps)
        cpath = Path(tmp) / "cluster.toml"
        cpath.write_text(L.dumps_cluster(cluster))
        for schedule, chunks in SCHEDULES:
            benchlib.say(
                f"{schedule}: hidden {hidden}, {layers} layers, seq {seq}, {batch} microbatches, {steps} steps"
            )
            lpath = Path(tmp) / f"{schedule}.toml"
            L.dump(schedule_layout(cluster, str(lpath), schedule, chunks, layers, batch), lpath)
            want = predicted(cpath, schedule, chunks, layers, batch)
            for rec, pred in zip(run(lpath, Path(tmp) / schedule), want):
                added = rec["peak_rss"] - rec["rss_after"]
                results.append(
                    {
                        "schedule": schedule,
                        "rank": rec["rank"],
                        "predicted_mib": pred / MIB,
                        "measured_mib": added / MIB,
                        "error": pred / max(added, 1) - 1,  # max: --quick's tiny peak can read 0
                        "rss_before_mib": rec["rss_before"] / MIB,
                        "peak_rss_mib": rec["peak_rss"] / MIB,
                        "after_mib": (rec["rss_after"] - rec["rss_before"]) / MIB,
                        "added_mib": (rec["peak_rss"] - rec["rss_before"]) / MIB,
                    }
                )
    load_after = benchlib.load_average()
    headers = [
        "schedule",
        "rank (stage)",
        "predicted MiB",
        "measured MiB (peak - after)",
        "error",
        "RSS before MiB",
        "peak RSS MiB",
        "after - before MiB",
        "peak - before MiB",
    ]
    rows = [
        [
            r["schedule"],
            r["rank"],
            f"{r['predicted_mib']:.1f}",
            f"{r['measured_mib']:.1f}",
            f"{r['error']:+.1%}",
            f"{r['rss_before_mib']:.0f}",
            f"{r['peak_rss_mib']:.0f}",
            f"{r['after_mib']:.1f}",
            f"{r['added_mib']:.1f}",
        ]
        for r in results
    ]
    within = sum(abs(r["error"]) <= 0.15 for r in results)
    md = "\n\n".join(
        [
            "\n".join(
                benchlib.report_head(
                    f"Planner memory model vs measured peak RSS (hidden {hidden}, ffn {ffn}, {layers} layers, "
                    f"seq {seq}, {batch} microbatches of 1 sequence, {steps} steps; 1 pipeline of 2 stages, 2 ranks, "
                    "gloo on CPU)",
                    benchlib.machine(),
                    load_before,
                    load_after,
                )
            ).rstrip(),
            benchlib.markdown_table(headers, rows),
            f"{within} of {len(results)} ranks within 15%. predicted: `PlannerCostModel.memory` (parameters, gradients "
            "and AdamW moments in float32, plus the larger of the activations of the schedule's peak microbatches in "
            "flight with the last stage's logits, and the optimizer step's denominator); measured: peak resident memory "
            "(VmHWM) minus the resident memory after training has returned (its parameters, gradients, moments and "
            "activations freed; what stays, the data set, lazily loaded libraries and gloo's buffers, is not training "
            "state). 'peak - before' counts from before training (after imports) instead: it includes what stays.",
        ]
    )
    payload = {
        "command": benchlib.command_line(),
        "machine": benchlib.machine(),
        "load_before": load_before,
        "load_after": load_after,
        "shape": {"hidden": hidden, "ffn": ffn, "layers": layers, "seq": seq, "microbatches": batch, "steps": steps},
        "results": results,
    }
    benchlib.write_results(args.out_dir, "plan_memory", md, payload)
    print(md)


if __name__ == "__main__":
    main()
