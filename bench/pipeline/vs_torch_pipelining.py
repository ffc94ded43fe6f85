"""Throughput of hetero_llm's pipeline runtime against ``torch.distributed.pipelining`` (CPU, gloo).

Both sides train the same tiny GPT (``hetero_llm.model.forward``'s functions and initialization), split into
the same stages, one process per stage, with the same global batch, microbatches, AdamW, clipping
and learning-rate schedule; ``torch_pp_rank.py`` is the baseline. The per-step losses of the two
sides are compared too: they must agree (same math), or the comparison means nothing.

Two measurements, both interleaved so that background load hits both sides alike:

1. separate runs: ``hetero-launch`` against one ``torch_pp_rank.py`` process per stage, whole runs
   alternating (ours, torch, torch, ours, ...); ratio = median over repetitions of the paired ratios;
2. paired rounds (``paired_rank.py``): each rank process holds both sides and runs them in
   alternating rounds of a few steps, ours through ``hetero_llm.train.rank.train`` (the loop
   ``hetero-launch`` runs); ratio = median over rounds. On a busy machine the load changes within
   seconds, so this is the more precise of the two.

    python -m bench.pipeline.vs_torch_pipelining                 # 2 and 4 stages x 1f1b, gpipe
    python -m bench.pipeline.vs_torch_pipelining --quick         # smoke run
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import attrs
import click

from bench.common import benchlib as B
from bench.common.traces import _split_steps
from bench.pipeline.paired import run_paired

NAME = "vs_torch_pipelining"


def even_split(layers: int, stages: int) -> list[int]:
    return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]


def run_torch(layout: Path, workdir: Path, world: int) -> list[dict]:
    """The baseline as separate processes; rank 0's metrics rows."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "metrics.jsonl"
    B.start_ranks(
        "bench.pipeline.torch_pp_rank",
        [str(layout), "--port", str(B.free_port()), "--metrics-jsonl", str(metrics)],
        world,
    )
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@attrs.frozen
class Run:
    tokens_s: float  # from the median step time
    tokens_s_best: float  # from the fastest step
    step_ms: float
    schedule_ms: float  # rank 0's pipeline schedule part of a step
    compute_ms: float  # rank 0's forwards and backwards


def measure_ours(seconds: list[float], events: list[tuple[str, float, float]], tokens: int, skip: int) -> Run:
    """From metrics seconds and rank 0's trace records (``(action, start, end)``)."""
    seconds = B.steady(seconds, skip)
    rank0 = B.steady(_split_steps([tuple(e) for e in events]), skip)
    return Run(
        tokens / B.median(seconds),
        tokens / min(seconds),
        1e3 * B.median(seconds),
        1e3 * B.median([row[-1][2] - row[0][1] for row in rank0]),
        1e3 * B.median([sum(e - s for a, s, e in row if a[0] in "FB") for row in rank0]),
    )


def measure_torch(rows: list[dict], tokens: int, skip: int) -> Run:
    rows = B.steady(rows, skip)
    seconds = [r["seconds"] for r in rows]
    return Run(
        tokens / B.median(seconds),
        tokens / min(seconds),
        1e3 * B.median(seconds),
        1e3 * B.median([r["schedule_seconds"] for r in rows]),
        1e3 * B.median([r["compute_seconds"] for r in rows]),
    )


def rank0_events(trace: Path) -> list[tuple[str, float, float]]:
    from hetero_llm.predict import trace as tracing

    return tracing.rank_rows(tracing.read_rank_traces(trace))[1][0]


def max_loss_difference(ours: list[dict], theirs: list[dict]) -> float:
    return max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(ours, theirs))


def summarize(n: int, k: int, pairs: list[tuple[Run, Run]], loss_diff: float) -> dict:
    ours, theirs = [a for a, _ in pairs], [b for _, b in pairs]
    ratios = [a.tokens_s / b.tokens_s for a, b in pairs]
    row = {
        "stages": n,
        "schedule": k,
        "ours_tokens_s": B.median([x.tokens_s for x in ours]),
        "torch_tokens_s": B.median([x.tokens_s for x in theirs]),
        "ratio": B.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_best_step": B.median([a.tokens_s_best / b.tokens_s_best for a, b in pairs]),
        "max_rel_loss_diff": loss_diff,
        "pairs": len(pairs),
    }
    for side, runs in (("ours", ours), ("torch", theirs)):
        for field in ("step_ms", "schedule_ms", "compute_ms"):
            row[f"{side}_{field}"] = B.median([getattr(x, field) for x in runs])
        row[f"{side}_runs"] = [attrs.asdict(x) for x in runs]
    return row


def ratio_table(results: list[dict]) -> str:
    return B.markdown_table(
        [
            "stages",
            "schedule",
            "ours tokens/s",
            "torch tokens/s",
            "ratio ours/torch",
            "ratio range",
            "ratio (fastest steps)",
            "pairs",
            "max rel. loss diff",
        ],
        [
            [
                r["stages"],
                r["schedule"],
                f"{r['ours_tokens_s']:.0f}",
                f"{r['torch_tokens_s']:.0f}",
                f"{r['ratio']:.3f}",
                f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
                f"{r['ratio_best_step']:.3f}",
                r["pairs"],
                f"{r['max_rel_loss_diff']:.1e}",
            ]
            for r in results
        ],
    )


def cpu_table(results: list[dict]) -> str:
    return B.markdown_table(
        ["stages", "schedule", "ours CPU s/step", "torch CPU s/step", "ours / torch"],
        [
            [
                r["stages"],
                r["schedule"],
                f"{r['ours_cpu_step_s']:.3f}",
                f"{r['torch_cpu_step_s']:.3f}",
                f"{r['ours_cpu_step_s'] / r['torch_cpu_step_s']:.3f}",
            ]
            for r in results
        ],
    )


def breakdown_table(results: list[dict]) -> str:
    return B.markdown_table(
        [
            "stages",
            "schedule",
            "side",
            "step ms",
            "schedule ms (rank 0)",
            "compute ms (rank 0)",
            "waits + runtime ms (rank 0)",
            "outside schedule ms",
        ],
        [
            [
                r["stages"],
                r["schedule"],
                side,
                f"{r[f'{side}_step_ms']:.1f}",
                f"{r[f'{side}_schedule_ms']:.1f}",
                f"{r[f'{side}_compute_ms']:.1f}",
                f"{r[f'{side}_schedule_ms'] - r[f'{side}_compute_ms']:.1f}",
                f"{r[f'{side}_step_ms'] - r[f'{side}_schedule_ms']:.1f}",
            ]
            for r in results
            for side in ("ours", "torch")
        ],
    )


def plot(separate: list[dict], paired: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = paired or separate
    fig, (left, right) = plt.subplots(1, 2, figsize=(4 + 2.2 * len(main), 3.8), dpi=120)
    x = list(range(len(main)))
    labels = [f"{r['stages']} st\n{r['schedule']}" for r in main]
    w = 0.38
    left.bar([i - w / 2 for i in x], [r["ours_tokens_s"] for r in main], w, label="hetero_llm", color="#4e79a7")
    left.bar([i + w / 2 for i in x], [r["torch_tokens_s"] for r in main], w, label="torch pipelining", color="#9c9c9c")
    left.set_xticks(x, labels)
    left.set_ylabel("tokens / s (median)")
    left.set_title("paired rounds" if paired else "separate runs", fontsize=9)
    left.legend(fontsize=7, loc="lower right")
    for j, (results, name, color) in enumerate(
        ((separate, "separate runs", "#f28e2b"), (paired, "paired rounds", "#4e79a7"))
    ):
        if not results:
            continue
        xs = [i + (j - 0.5) * w for i in range(len(results))]
        right.bar(xs, [r["ratio"] for r in results], w, label=name, color=color)
        right.errorbar(
            xs,
            [r["ratio"] for r in results],
            yerr=[[r["ratio"] - r["ratio_min"] for r in results], [r["ratio_max"] - r["ratio"] for r in results]],
            fmt="none",
            ecolor="black",
            capsize=3,
            lw=0.8,
        )
    right.axhline(1.0, color="black", lw=0.8)
    right.axhline(1.1, color="black", lw=0.8, ls="--")
    right.set_xticks(x, labels)
    right.set_ylabel("ours / torch tokens/s (range: min-max)")
    right.legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--stages", default="2,4", show_default=True, help="Comma-separated stage counts.")
@click.option("--schedules", default="1f1b,gpipe", show_default=True, help="Comma-separated: 1f1b, gpipe.")
@click.option("--reps", default=3, show_default=True, help="Separate runs per configuration and side (0: skip).")
@click.option("--steps", default=10, show_default=True, help="Optimizer steps per separate run.")
@click.option("--skip", default=2, show_default=True, help="Warm-up steps left out of a separate run's median.")
@click.option("--rounds", default=8, show_default=True, help="Paired rounds per side (0: skip).")
@click.option("--round-steps", default=4, show_default=True, help="Steps per paired round (the first is warm-up).")
@click.option("--layers", default=8, show_default=True)
@click.option("--hidden", default=128, show_default=True)
@click.option("--seq-len", default=128, show_default=True)
@click.option("--batch", default=16, show_default=True, help="Global batch (sequences per step).")
@click.option("--microbatches", default=8, show_default=True)
@click.option("--quick", is_flag=True, help="Smoke run: 2 stages, 1f1b, tiny model, 1 repetition, 2 rounds.")
@click.option(
    "--out-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=B.RESULTS,
    show_default=True,
    help="Where the .md, .json and .png results go.",
)
def main(
    stages,
    schedules,
    reps,
    steps,
    skip,
    rounds,
    round_steps,
    layers,
    hidden,
    seq_len,
    batch,
    microbatches,
    quick,
    out_dir,
):
    """hetero_llm vs torch.distributed.pipelining: tokens/s per (stages, schedule), ratio ours/torch."""
    stage_counts = [int(s) for s in stages.split(",")]
    kinds = [s.strip() for s in schedules.split(",")]
    cfg = B.ModelConfig(layers=layers, hidden=hidden, seq_len=seq_len, global_batch=batch, steps=steps)
    if quick:
        stage_counts, kinds, reps, skip, rounds, round_steps = [2], ["1f1b"], 1, 1, 2, 2
        cfg = B.ModelConfig(layers=2, hidden=32, heads=4, vocab=64, seq_len=16, global_batch=4, steps=3)
        microbatches = 2
    tokens = cfg.tokens_per_step
    info, before = B.machine(), B.load_average()
    B.say(f"{NAME}: {B.machine_line(info)}; load {before[0]:.2f}")
    configs = [(n, k) for n in stage_counts for k in kinds]
    separate_pairs: dict = {c: [] for c in configs}
    loss_diff: dict = {c: 0.0 for c in configs}
    paired_results, separate_results = [], []
    with tempfile.TemporaryDirectory(prefix="bench_vs_torch_") as tmp:
        layouts = {}
        for n, k in configs:
            layouts[(n, k)] = Path(tmp, f"s{n}_{k}.toml")
            layouts[(n, k)].write_text(B.layout_toml(cfg, even_split(cfg.layers, n), microbatches, k))
        if rounds:
            for n, k in configs:
                got = run_paired(layouts[(n, k)], Path(tmp, f"paired_s{n}_{k}"), n, rounds, round_steps)
                pairs = [
                    (measure_ours([m["seconds"] for m in o], ev, tokens, 1), measure_torch(t, tokens, 1))
                    for o, ev, t in zip(got["ours"], got["ours_events"], got["other"])
                ]
                diff = max(max_loss_difference(o, t) for o, t in zip(got["ours"], got["other"]))
                paired_results.append(summarize(n, k, pairs, diff))
                r = paired_results[-1]
                for side in ("ours", "torch"):  # CPU seconds per step, all ranks together, median over rounds
                    key = "ours" if side == "ours" else "other"
                    per_round = [sum(rank_cpu[key][i] for rank_cpu in got["cpu"]) / round_steps for i in range(rounds)]
                    r[f"{side}_cpu_step_s"] = B.median(per_round)
                B.say(
                    f"paired {n} stages {k:5}: ours {r['ours_tokens_s']:.0f}, torch {r['torch_tokens_s']:.0f} tokens/s, "
                    f"ratio {r['ratio']:.3f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) over {rounds} rounds "
                    f"(load {B.load_average()[0]:.2f})"
                )
        for rep in range(reps):
            for n, k in configs:
                rows, measured = {}, {}
                for side in ("ours", "torch") if rep % 2 == 0 else ("torch", "ours"):
                    work = Path(tmp, f"{side}_s{n}_{k}_r{rep}")
                    if side == "ours":
                        rows[side] = B.run_layout(layouts[(n, k)], work, trace=work / "trace")
                        run = measure_ours(
                            [r["seconds"] for r in rows[side]], rank0_events(work / "trace"), tokens, skip
                        )
                    else:
                        rows[side] = run_torch(layouts[(n, k)], work, n)
                        run = measure_torch(rows[side], tokens, skip)
                    measured[side] = run
                    B.say(
                        f"rep {rep + 1}/{reps} {n} stages {k:5} {side:5}: {run.tokens_s:8.0f} tokens/s "
                        f"(step {run.step_ms:.0f} ms: schedule {run.schedule_ms:.0f}, compute {run.compute_ms:.0f}) "
                        f"(load {B.load_average()[0]:.2f})"
                    )
                separate_pairs[(n, k)].append((measured["ours"], measured["torch"]))
                loss_diff[(n, k)] = max(loss_diff[(n, k)], max_loss_difference(rows["ours"], rows["torch"]))
        if reps:
            separate_results = [summarize(n, k, separate_pairs[(n, k)], loss_diff[(n, k)]) for n, k in configs]
    after = B.load_average()
    setup = (
        f"model: GPT (LayerNorm, learned positions, GELU), {cfg.layers} layers, hidden {cfg.hidden}, "
        f"{cfg.heads} heads, vocab {cfg.vocab}, seq {cfg.seq_len}; global batch {cfg.global_batch}, "
        f"{microbatches} microbatches; stages of equal layers, one process per stage; AdamW, clipping 1.0"
    )
    parts = [*B.report_head(NAME, info, before, after), setup, ""]
    if paired_results:
        parts += [
            f"## Paired rounds ({rounds} rounds of {round_steps} steps per side, first step of a round left out)",
            "",
            ratio_table(paired_results),
            "",
            breakdown_table(paired_results),
            "",
            "CPU seconds per step, every rank's process together (user + system, all threads; a round's "
            "setup included), median over rounds: the same math, so a difference is runtime overhead, and "
            "the load of other programs does not change it:",
            "",
            cpu_table(paired_results),
            "",
        ]
    if separate_results:
        parts += [
            f"## Separate runs ({reps} runs of {cfg.steps} steps per side, first {skip} steps left out)",
            "",
            ratio_table(separate_results),
            "",
            breakdown_table(separate_results),
            "",
        ]
    parts += [
        "ratio: median over pairs of (ours / torch) tokens/s; ratio (fastest steps): the same from each "
        "round's or run's fastest step (less sensitive to background load). Breakdown (medians; rank 0 = first "
        "stage): schedule = the pipeline part of a step, compute = its forwards and backwards (torch: "
        "forward_one_chunk / backward_one_chunk; the loss is outside its forward), outside = gradient norm, "
        "clipping, AdamW and data.",
        "",
        f"![{NAME}]({NAME}.png)",
        "",
    ]
    payload = {
        "name": NAME,
        "command": B.command_line(),
        "machine": info,
        "load_before": before,
        "load_after": after,
        "results": paired_results or separate_results,
        "paired": paired_results,
        "separate": separate_results,
        "config": {
            **attrs.asdict(cfg),
            "microbatches": microbatches,
            "reps": reps,
            "skip": skip,
            "rounds": rounds,
            "round_steps": round_steps,
        },
    }
    md_path, _ = B.write_results(out_dir, NAME, "\n".join(parts), payload)
    plot(
        separate_results,
        paired_results,
        out_dir / f"{NAME}.png",
        f"hetero_llm vs torch.distributed.pipelining ({info['cores']}-core CPU, gloo)",
    )
    print()
    print("\n".join(parts[9:-3]))
    B.say(f"wrote {md_path}, {md_path.with_suffix('.json')}, {md_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
