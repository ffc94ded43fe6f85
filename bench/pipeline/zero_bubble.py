"""Zero-bubble ZB-H1 against 1F1B on the same layouts: measured speedup, bubble, and the simulator's prediction.

One pipeline of 2 and of 4 even stages on CPU (gloo, one process per stage). Per layout:

1. paired rounds (``paired_rank.py --versus zbh1``): the same rank processes run
   ``hetero_llm.train.rank.train`` with 1F1B and with ZB-H1 in alternating rounds of a few steps, so
   load that changes within seconds hits both alike; ratio = median over rounds; each rank's process
   CPU time per round is counted too (the split backward's extra cost shows there);
2. separate ``hetero-launch --trace`` runs, interleaved, from which the bubble fraction, the
   per-stage F / B (1F1B) and F / I / W (ZB-H1) compute times and the timeline PNGs come;
3. ``simulate`` of both schedules with those measured times and the measured gloo p2p cost: the
   speedup the cost model predicts for the same layout, beside the measured one.

    python -m bench.pipeline.zero_bubble
    python -m bench.pipeline.zero_bubble --quick
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import attrs
import click

from bench.common import benchlib as B
from bench.common.traces import bubble_fraction, compute_intervals, trace_steps
from bench.pipeline.paired import run_paired

NAME = "zero_bubble"
SCHEDULES = ("1f1b", "zbh1")


def summarize_paired(got: dict, tokens: int, steps: int) -> dict:
    def rate(rows):
        return tokens / B.median([r["seconds"] for r in B.steady(rows, 1)])

    base, zb = [rate(rows) for rows in got["ours"]], [rate(rows) for rows in got["other"]]
    ratios = [z / b for b, z in zip(base, zb)]
    cpu = {
        side: B.median([sum(rank[side][i] for rank in got["cpu"]) / steps for i in range(len(ratios))])
        for side in ("ours", "other")
    }
    losses = max(
        abs(a["loss"] - b["loss"]) / abs(b["loss"]) for x, y in zip(got["ours"], got["other"]) for a, b in zip(x, y)
    )
    return {
        "1f1b_tokens_s": B.median(base),
        "zbh1_tokens_s": B.median(zb),
        "ratio": B.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "rounds": len(ratios),
        "ratios": ratios,
        "1f1b_cpu_step_s": cpu["ours"],
        "zbh1_cpu_step_s": cpu["other"],
        "max_rel_loss_diff": losses,
    }


@attrs.frozen
class Traced:
    tokens_s: float
    bubble: float
    times: dict  # action kind -> median seconds per stage, e.g. {"F": [...], "I": [...], "W": [...]}


def analyse(trace: Path, rows: list[dict], tokens: int, skip: int) -> Traced:
    steps = B.steady(trace_steps(trace), skip)
    samples: dict[str, list[list[float]]] = {}
    for step in steps:
        for stage, row in enumerate(compute_intervals(step)):
            for action, start, end in row:
                samples.setdefault(action[0], [[] for _ in step])[stage].append(end - start)
    return Traced(
        B.tokens_per_second([r["seconds"] for r in rows], tokens, skip),
        B.median([bubble_fraction(step) for step in steps]),
        {kind: [B.median(v) for v in per_stage] for kind, per_stage in samples.items()},
    )


def predict(plan_schedule, traced: Traced, latency: float, bandwidth: float, activation_bytes: float):
    """``simulate`` one pipeline schedule with the measured per-stage compute times."""
    from hetero_llm.predict.simulate import CostModel, simulate

    t = traced.times
    split = "I" in t
    backward = [i + w for i, w in zip(t["I"], t["W"])] if split else t["B"]
    links = len(t["F"]) - 1
    return simulate(
        plan_schedule,
        CostModel(
            forward=t["F"],
            backward=backward,
            latency=[latency] * links,
            bandwidth=[bandwidth] * links,
            activation_bytes=activation_bytes,
            weight=t["W"] if split else None,
        ),
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--stages", "stage_counts", default="2,4", show_default=True, help="Pipelines of these many even stages.")
@click.option("--microbatches", default=8, show_default=True)
@click.option("--rounds", default=10, show_default=True, help="Paired rounds per schedule.")
@click.option("--round-steps", default=4, show_default=True, help="Steps per paired round (the first is warm-up).")
@click.option("--reps", default=2, show_default=True, help="Separate traced runs per schedule and layout.")
@click.option("--steps", default=8, show_default=True, help="Steps of each traced run.")
@click.option("--skip", default=2, show_default=True, help="Warm-up steps left out of the traced medians.")
@click.option("--layers", default=8, show_default=True)
@click.option("--hidden", default=128, show_default=True)
@click.option("--seq-len", default=128, show_default=True)
@click.option("--batch", default=16, show_default=True, help="Global batch (sequences per step).")
@click.option("--quick", is_flag=True, help="Smoke run: 2 stages, tiny model, 2 rounds, 1 traced run.")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=B.RESULTS, show_default=True)
def main(
    stage_counts, microbatches, rounds, round_steps, reps, steps, skip, layers, hidden, seq_len, batch, quick, out_dir
):
    """tokens/s of ZB-H1 vs 1F1B (paired), bubbles, and the simulator's predicted speedup."""
    from hetero_llm import layout as layout_mod
    from hetero_llm.plan import compile_plan
    from hetero_llm.predict.timeline import plot_timeline

    cfg = B.ModelConfig(layers=layers, hidden=hidden, seq_len=seq_len, global_batch=batch, steps=steps)
    counts = [int(n) for n in stage_counts.split(",")]
    if quick:
        counts, microbatches, rounds, round_steps, reps, skip = [2], 4, 2, 2, 1, 1
        cfg = B.ModelConfig(layers=2, hidden=32, heads=4, vocab=64, seq_len=16, global_batch=4, steps=3)
    info, before = B.machine(), B.load_average()
    B.say(f"{NAME}: {B.machine_line(info)}; load {before[0]:.2f}")
    act_bytes = 4 * (cfg.global_batch // microbatches) * cfg.seq_len * cfg.hidden
    latency, bandwidth = B.p2p_probe(reps=10 if quick else 50, big=1 << 16 if quick else 1 << 20, fork=quick)
    out_dir.mkdir(parents=True, exist_ok=True)
    results, pngs = [], []
    with tempfile.TemporaryDirectory(prefix="bench_zb_") as tmp:
        for n in counts:
            split = [cfg.layers // n + (1 if i < cfg.layers % n else 0) for i in range(n)]
            layouts = {k: Path(tmp, f"s{n}_{k}.toml") for k in SCHEDULES}
            for k, path in layouts.items():
                path.write_text(B.layout_toml(cfg, split, microbatches, k))
            got = run_paired(layouts["1f1b"], Path(tmp, f"paired_s{n}"), n, rounds, round_steps, versus="zbh1")
            paired = summarize_paired(got, cfg.tokens_per_step, round_steps)
            B.say(
                f"paired {n} stages: 1f1b {paired['1f1b_tokens_s']:.0f}, zbh1 {paired['zbh1_tokens_s']:.0f} tokens/s, "
                f"ratio {paired['ratio']:.3f} ({paired['ratio_min']:.2f}-{paired['ratio_max']:.2f}) over {rounds} "
                f"rounds; CPU s/step {paired['1f1b_cpu_step_s']:.3f} vs {paired['zbh1_cpu_step_s']:.3f} "
                f"(load {B.load_average()[0]:.2f})"
            )
            traced: dict[str, list[Traced]] = {k: [] for k in SCHEDULES}
            for rep in range(reps):
                for k in SCHEDULES if rep % 2 == 0 else SCHEDULES[::-1]:
                    work = Path(tmp, f"s{n}_{k}_r{rep}")
                    rows = B.run_layout(layouts[k], work, trace=work / "trace")
                    traced[k].append(analyse(work / "trace", rows, cfg.tokens_per_step, skip))
                    B.say(
                        f"rep {rep + 1}/{reps} {n} stages {k:5}: {traced[k][-1].tokens_s:.0f} tokens/s, bubble "
                        f"{traced[k][-1].bubble:.1%} (load {B.load_average()[0]:.2f})"
                    )
            last = {k: traced[k][-1] for k in SCHEDULES}
            sims = {
                k: predict(
                    compile_plan(layout_mod.load(layouts[k])).schedules[0], last[k], latency, bandwidth, act_bytes
                )
                for k in SCHEDULES
            }
            for k in SCHEDULES:
                png = f"{NAME}_s{n}_{k}.png"
                work = Path(tmp, f"s{n}_{k}_r{reps - 1}")
                step = trace_steps(work / "trace")[min(skip, len(trace_steps(work / "trace")) - 1)]
                plot_timeline(step, out_dir / png, f"{k}, {n} stages, {microbatches} microbatches: one step (measured)")
                pngs.append(png)
            t = last["zbh1"].times
            results.append(
                {
                    "stages": n,
                    "stage_layers": split,
                    **paired,
                    "bubble_1f1b": B.median([r.bubble for r in traced["1f1b"]]),
                    "bubble_zbh1": B.median([r.bubble for r in traced["zbh1"]]),
                    "separate_ratio": B.median(
                        [z.tokens_s / b.tokens_s for b, z in zip(traced["1f1b"], traced["zbh1"])]
                    ),
                    "predicted_ratio": sims["1f1b"].step_time / sims["zbh1"].step_time,
                    "predicted_bubble_1f1b": sims["1f1b"].mean_bubble,
                    "predicted_bubble_zbh1": sims["zbh1"].mean_bubble,
                    "predicted_peak_in_flight_zbh1": list(sims["zbh1"].peak_in_flight),
                    "predicted_peak_in_flight_1f1b": list(sims["1f1b"].peak_in_flight),
                    "times_ms": {
                        k: {kind: [1e3 * x for x in v] for kind, v in last[k].times.items()} for k in SCHEDULES
                    },
                    "split_cost": sum(i + w for i, w in zip(t["I"], t["W"])) / sum(last["1f1b"].times["B"]),
                }
            )
    after = B.load_average()
    table = B.markdown_table(
        [
            "stages",
            "1f1b tokens/s",
            "zbh1 tokens/s",
            "ratio zbh1/1f1b",
            "ratio range",
            "rounds",
            "separate runs ratio",
            "simulated ratio",
            "bubble 1f1b",
            "bubble zbh1",
            "bubble simulated 1f1b / zbh1",
            "CPU s/step 1f1b / zbh1",
            "(I + W) / B",
        ],
        [
            [
                r["stages"],
                f"{r['1f1b_tokens_s']:.0f}",
                f"{r['zbh1_tokens_s']:.0f}",
                f"{r['ratio']:.3f}",
                f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
                r["rounds"],
                f"{r['separate_ratio']:.3f}",
                f"{r['predicted_ratio']:.3f}",
                f"{r['bubble_1f1b']:.1%}",
                f"{r['bubble_zbh1']:.1%}",
                f"{r['predicted_bubble_1f1b']:.1%} / {r['predicted_bubble_zbh1']:.1%}",
                f"{r['1f1b_cpu_step_s']:.3f} / {r['zbh1_cpu_step_s']:.3f}",
                f"{r['split_cost']:.3f}",
            ]
            for r in results
        ],
    )
    times = B.markdown_table(
        ["stages", "1f1b F ms", "1f1b B ms", "zbh1 F ms", "zbh1 I ms", "zbh1 W ms"],
        [
            [
                r["stages"],
                *(
                    " / ".join(f"{x:.1f}" for x in r["times_ms"][k][kind])
                    for k, kind in (("1f1b", "F"), ("1f1b", "B"), ("zbh1", "F"), ("zbh1", "I"), ("zbh1", "W"))
                ),
            ]
            for r in results
        ],
    )
    setup = (
        f"layouts: one pipeline of even stages, GPT {cfg.layers} layers hidden {cfg.hidden} seq {cfg.seq_len}, "
        f"global batch {cfg.global_batch} in {microbatches} microbatches; paired rounds of {round_steps} steps "
        f"(first left out); {reps} traced runs of {cfg.steps} steps per schedule (medians over steps {skip + 1}..); "
        f"gloo p2p latency {latency * 1e6:.0f} us, bandwidth {bandwidth / 1e9:.2f} GB/s"
    )
    md = "\n".join(
        [
            *B.report_head(NAME, info, before, after),
            setup,
            "",
            table,
            "",
            "ratio: paired rounds in the same rank processes (median, min-max); separate runs: traced "
            "hetero-launch runs; simulated: simulate() of both action lists with the measured per-stage "
            "compute times (stages never share a core there); bubble: idle fraction of all stages over a "
            "step (trace); (I + W) / B: what splitting the backward costs in compute.",
            "",
            "Per-stage compute times of the last traced run (median per action):",
            "",
            times,
            "",
        ]
        + [f"![{png}]({png})" for png in pngs]
    )
    payload = {
        "name": NAME,
        "command": B.command_line(),
        "machine": info,
        "load_before": before,
        "load_after": after,
        "p2p": {"latency_s": latency, "bandwidth_bytes_s": bandwidth, "activation_bytes": act_bytes},
        "config": {
            **attrs.asdict(cfg),
            "microbatches": microbatches,
            "rounds": rounds,
            "round_steps": round_steps,
            "reps": reps,
            "skip": skip,
        },
        "results": results,
    }
    md_path, _ = B.write_results(out_dir, NAME, md, payload)
    B.plot_pair_bars(
        results,
        (("1f1b", "#9c9c9c"), ("zbh1", "#b07aa1")),
        lambda r: f"{r['stages']} stages",
        out_dir / f"{NAME}.png",
        f"ZB-H1 vs 1F1B ({info['cores']}-core CPU, gloo)",
        note=lambda r: f"{r['ratio']:.2f}x (sim {r['predicted_ratio']:.2f}x)",
    )
    print()
    print(table)
    print()
    print(times)
    print()
    B.say(f"wrote {md_path}, {md_path.with_suffix('.json')}, {md_path.with_suffix('.png')} and timelines")


if __name__ == "__main__":
    main()
