"""Dynamic pipeline schedule (MegatronDPP) against 1F1B on the same layout, with and without a slow, jittery stage.

One pipeline of 4 even stages on CPU (gloo). Two scenarios:

- ``jitter``: the runtime's emulation makes stage ``--slow-rank`` ``--slowdown`` times slower and
  every stage jittery: after each forward/backward a rank sleeps ``(slowdown - 1 + U(0, jitter))``
  times its compute time (``HETERO_EMULATE_SLOWDOWN`` / ``HETERO_EMULATE_JITTER``);
- ``even``: no emulation.

Two measurements per scenario, both interleaved so that background load hits both alike:

1. paired rounds (``paired_rank.py --versus dynamic``): the same rank processes run
   ``hetero_llm.train.rank.train`` with 1F1B and with dynamic in alternating rounds of a few steps;
   ratio = median over rounds; each rank's process CPU time per round is counted too;
2. separate ``hetero-launch`` runs, the order flipped every repetition; every run records
   ``--trace``, from which the bubble fraction is read and the timeline PNGs of one step are drawn.
 A Monte-Carlo model of the policies with the measured per-stage times (``bench/pipeline/policy_model.py``'s
``model_policies``: the library's simulator runs fixed action lists only) shows what a
policy itself can gain when compute times are drawn like the emulation draws them, next to a
lower bound for any order and to variants the runtime does not have (forward first, more
microbatches in flight).

    python -m bench.pipeline.dynamic_vs_1f1b
    python -m bench.pipeline.dynamic_vs_1f1b --quick
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import attrs
import click

from bench.common import benchlib as B
from bench.common.traces import bubble_fraction, compute_intervals, trace_steps
from bench.pipeline.paired import paired_rates, run_paired
from bench.pipeline.policy_model import WHAT_IF_POLICIES, model_policies

NAME = "dynamic_vs_1f1b"
SCHEDULES = ("1f1b", "dynamic")


def emulation_env(slow_rank: int, slowdown: float, jitter: float) -> dict[str, str]:
    return {"HETERO_EMULATE_SLOWDOWN": f"{slow_rank}:{slowdown}", "HETERO_EMULATE_JITTER": f"*:{jitter}"}


# ------------------------------------------------------------------------------------------


def summarize_paired(scenario: str, got: dict, tokens: int, steps: int) -> dict:
    fixed, dynamic, cpu = paired_rates(got, tokens, steps)
    ratios = [d / f for f, d in zip(fixed, dynamic)]
    rounds = len(ratios)
    return {
        "scenario": scenario,
        "1f1b_tokens_s": B.median(fixed),
        "dynamic_tokens_s": B.median(dynamic),
        "ratio": B.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "rounds": rounds,
        "1f1b_cpu_step_s": cpu["ours"],
        "dynamic_cpu_step_s": cpu["other"],
        "ratios": ratios,
    }


@attrs.frozen
class RunResult:
    tokens_s: float
    bubble: float
    forward: list[float]  # median compute seconds per stage (emulated slowdown included)
    backward: list[float]
    trace: Path
    cpu_s: float  # CPU seconds of the whole run, every rank (startup included)
    compute_s: float  # seconds of forwards and backwards per step, every rank together (median over steps)


def analyse(trace: Path, launch: B.Launch, cfg: B.ModelConfig, skip: int) -> RunResult:
    rows = launch.rows
    steps = B.steady(trace_steps(trace), skip)
    stages = len(steps[0])
    fwd = [[] for _ in range(stages)]
    bwd = [[] for _ in range(stages)]
    for step in steps:
        for s, row in enumerate(compute_intervals(step)):
            for a, start, end in row:
                (fwd if a.startswith("F") else bwd)[s].append(end - start)
    return RunResult(
        B.tokens_per_second([r["seconds"] for r in rows], cfg.tokens_per_step, skip),
        B.median([bubble_fraction(step) for step in steps]),
        [B.median(v) for v in fwd],
        [B.median(v) for v in bwd],
        trace,
        launch.cpu_s,
        B.median([sum(e - s for row in compute_intervals(step) for _, s, e in row) for step in steps]),
    )


def draw_timeline(trace: Path, step: int, path: Path, title: str) -> None:
    from hetero_llm.predict import trace as tracing
    from hetero_llm.predict.timeline import plot_timeline

    labels, _ = tracing.rank_rows(tracing.read_rank_traces(trace))
    rows = trace_steps(trace)[step]
    plot_timeline(rows, path, title, labels=labels)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--stages", default=4, show_default=True)
@click.option("--microbatches", default=8, show_default=True)
@click.option("--reps", default=3, show_default=True, help="Interleaved repetitions per scenario and schedule.")
@click.option("--steps", default=10, show_default=True)
@click.option("--skip", default=2, show_default=True, help="Warm-up steps left out of the medians.")
@click.option("--layers", default=8, show_default=True)
@click.option("--hidden", default=128, show_default=True)
@click.option("--seq-len", default=128, show_default=True)
@click.option("--batch", default=16, show_default=True, help="Global batch (sequences per step).")
@click.option("--slow-rank", default=2, show_default=True, help="The stage made slower in the jitter scenario.")
@click.option("--slowdown", default=1.5, show_default=True)
@click.option("--jitter", default=0.6, show_default=True, help="Every stage's jitter U(0, jitter) x compute time.")
@click.option("--scenarios", default="jitter,even", show_default=True)
@click.option("--rounds", default=10, show_default=True, help="Paired rounds per schedule (0: skip).")
@click.option("--round-steps", default=4, show_default=True, help="Steps per paired round (the first is warm-up).")
@click.option("--quick", is_flag=True, help="Smoke run: 2 stages, tiny model, 1 repetition, 3 steps.")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=B.RESULTS, show_default=True)
def main(
    stages,
    microbatches,
    reps,
    steps,
    skip,
    layers,
    hidden,
    seq_len,
    batch,
    slow_rank,
    slowdown,
    jitter,
    scenarios,
    rounds,
    round_steps,
    quick,
    out_dir,
):
    """tokens/s of dynamic vs 1F1B, with a slow jittery stage and with even stages."""
    cfg = B.ModelConfig(layers=layers, hidden=hidden, seq_len=seq_len, global_batch=batch, steps=steps)
    if quick:
        stages, microbatches, reps, skip, slow_rank, scenarios, rounds, round_steps = 2, 4, 1, 1, 1, "jitter", 2, 2
        cfg = B.ModelConfig(layers=2, hidden=32, heads=4, vocab=64, seq_len=16, global_batch=4, steps=3)
    names = [s.strip() for s in scenarios.split(",")]
    envs = {"jitter": emulation_env(slow_rank, slowdown, jitter), "even": {}}
    info, before = B.machine(), B.load_average()
    B.say(f"{NAME}: {B.machine_line(info)}; load {before[0]:.2f}")
    split = [cfg.layers // stages + (1 if i < cfg.layers % stages else 0) for i in range(stages)]
    out_dir.mkdir(parents=True, exist_ok=True)
    measured: dict[tuple[str, str], list[RunResult]] = {(n, k): [] for n in names for k in SCHEDULES}
    with tempfile.TemporaryDirectory(prefix="bench_dynamic_") as tmp:
        layouts = {}
        for k in SCHEDULES:
            layouts[k] = Path(tmp, f"{k}.toml")
            layouts[k].write_text(B.layout_toml(cfg, split, microbatches, k))
        paired_rounds = []
        for n in names if rounds else []:
            got = run_paired(
                layouts["1f1b"], Path(tmp, f"paired_{n}"), stages, rounds, round_steps, versus="dynamic", env=envs[n]
            )
            paired_rounds.append(summarize_paired(n, got, cfg.tokens_per_step, round_steps))
            p = paired_rounds[-1]
            B.say(
                f"paired {n:6}: 1f1b {p['1f1b_tokens_s']:.0f}, dynamic {p['dynamic_tokens_s']:.0f} tokens/s, ratio "
                f"{p['ratio']:.3f} ({p['ratio_min']:.2f}-{p['ratio_max']:.2f}) over {rounds} rounds; CPU s/step "
                f"{p['1f1b_cpu_step_s']:.3f} vs {p['dynamic_cpu_step_s']:.3f} (load {B.load_average()[0]:.2f})"
            )
        for rep in range(reps):
            for n in names:
                for k in SCHEDULES if rep % 2 == 0 else SCHEDULES[::-1]:
                    work = Path(tmp, f"{n}_{k}_r{rep}")
                    launch = B.launch_layout(layouts[k], work, env=envs[n], trace=work / "trace")
                    r = analyse(work / "trace", launch, cfg, skip)
                    measured[(n, k)].append(r)
                    B.say(
                        f"rep {rep + 1}/{reps} {n:6} {k:7}: {r.tokens_s:8.0f} tokens/s, bubble {r.bubble:.1%}, CPU {r.cpu_s:.1f} s "
                        f"(load {B.load_average()[0]:.2f})"
                    )
        # timelines of one steady step of the last repetition
        pngs = {}
        for n in names:
            for k in SCHEDULES:
                png = out_dir / f"{NAME}_{n}_{k}.png"
                last = measured[(n, k)][-1]
                draw_timeline(
                    last.trace,
                    min(skip + 1, len(trace_steps(last.trace)) - 1),
                    png,
                    f"{k}, {n} ({stages} stages, {microbatches} microbatches): one step",
                )
                pngs[(n, k)] = png.name
    after = B.load_average()
    results = []
    for n in names:
        a, d = measured[(n, "1f1b")], measured[(n, "dynamic")]
        paired = [y.tokens_s / x.tokens_s for x, y in zip(a, d)]
        # the same comparison in the Monte-Carlo model, fed with this scenario's measured 1F1B compute times
        fwd, bwd = (
            [B.median([r.forward[s] for r in a]) for s in range(stages)],
            [B.median([r.backward[s] for r in a]) for s in range(stages)],
        )
        if n == "jitter":  # measured times include the emulation; take it out, the model draws it again
            mean = [(slowdown if s == slow_rank else 1.0) + jitter / 2 for s in range(stages)]
            fwd, bwd = [f / m for f, m in zip(fwd, mean)], [b / m for b, m in zip(bwd, mean)]

            def multiplier(s, rng):
                return (slowdown if s == slow_rank else 1.0) + rng.uniform(0, jitter)
        else:

            def multiplier(s, rng):
                return 1.0

        model = model_policies(
            fwd, bwd, microbatches, multiplier, latency=1e-4, steps=100 if not quick else 5, policies=WHAT_IF_POLICIES
        )
        results.append(
            {
                "scenario": n,
                "1f1b_tokens_s": B.median([r.tokens_s for r in a]),
                "dynamic_tokens_s": B.median([r.tokens_s for r in d]),
                "ratio": B.median(paired),
                "ratio_min": min(paired),
                "ratio_max": max(paired),
                "1f1b_bubble": B.median([r.bubble for r in a]),
                "dynamic_bubble": B.median([r.bubble for r in d]),
                "1f1b_cpu_s": B.median([r.cpu_s for r in a]),
                "dynamic_cpu_s": B.median([r.cpu_s for r in d]),
                "1f1b_compute_s": B.median([r.compute_s for r in a]),
                "dynamic_compute_s": B.median([r.compute_s for r in d]),
                "model_ratio": model["1f1b"] / model["dynamic"],
                "model_step_s": model,
                "stage_forward_s": fwd,
                "stage_backward_s": bwd,
                "1f1b_runs": [r.tokens_s for r in a],
                "dynamic_runs": [r.tokens_s for r in d],
                "timelines": {k: pngs[(n, k)] for k in SCHEDULES},
            }
        )
    headers = [
        "scenario",
        "1f1b tokens/s",
        "dynamic tokens/s",
        "ratio dynamic/1f1b",
        "ratio range",
        "bubble 1f1b",
        "bubble dynamic",
        "compute ms 1f1b",
        "compute ms dynamic",
        "CPU s 1f1b",
        "CPU s dynamic",
        "model ratio",
    ]
    table = B.markdown_table(
        headers,
        [
            [
                r["scenario"],
                f"{r['1f1b_tokens_s']:.0f}",
                f"{r['dynamic_tokens_s']:.0f}",
                f"{r['ratio']:.3f}",
                f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
                f"{r['1f1b_bubble']:.1%}",
                f"{r['dynamic_bubble']:.1%}",
                f"{1e3 * r['1f1b_compute_s']:.0f}",
                f"{1e3 * r['dynamic_compute_s']:.0f}",
                f"{r['1f1b_cpu_s']:.1f}",
                f"{r['dynamic_cpu_s']:.1f}",
                f"{r['model_ratio']:.3f}",
            ]
            for r in results
        ],
    )
    policy_names = [p.name for p in WHAT_IF_POLICIES] + ["bound"]
    what_if = B.markdown_table(
        ["scenario", *policy_names],
        [
            [r["scenario"], *(f"{r['model_step_s']['1f1b'] / r['model_step_s'][p]:.3f}x" for p in policy_names)]
            for r in results
        ],
    )
    setup = (
        f"layout: 1 pipeline, {stages} stages x {split} layers, {microbatches} microbatches, global batch "
        f"{cfg.global_batch}, GPT {cfg.layers} layers hidden {cfg.hidden} seq {cfg.seq_len}; {cfg.steps} steps, "
        f"medians over steps {skip + 1}..; {reps} interleaved repetitions. jitter scenario: "
        f"HETERO_EMULATE_SLOWDOWN={envs['jitter']['HETERO_EMULATE_SLOWDOWN']} "
        f"HETERO_EMULATE_JITTER={envs['jitter']['HETERO_EMULATE_JITTER']}"
    )
    paired_table = B.markdown_table(
        [
            "scenario",
            "1f1b tokens/s",
            "dynamic tokens/s",
            "ratio dynamic/1f1b",
            "ratio range",
            "rounds",
            "1f1b CPU s/step",
            "dynamic CPU s/step",
            "dynamic / 1f1b CPU",
        ],
        [
            [
                p["scenario"],
                f"{p['1f1b_tokens_s']:.0f}",
                f"{p['dynamic_tokens_s']:.0f}",
                f"{p['ratio']:.3f}",
                f"{p['ratio_min']:.2f}-{p['ratio_max']:.2f}",
                p["rounds"],
                f"{p['1f1b_cpu_step_s']:.3f}",
                f"{p['dynamic_cpu_step_s']:.3f}",
                f"{p['dynamic_cpu_step_s'] / p['1f1b_cpu_step_s']:.3f}",
            ]
            for p in paired_rounds
        ],
    )
    paired_part = (
        [
            f"## Paired rounds ({rounds} rounds of {round_steps} steps per schedule in the same rank processes, "
            "alternating; first step of a round left out)",
            "",
            paired_table,
            "",
            "CPU s/step: every rank's process CPU time (all threads) per step, median over rounds.",
            "",
            f"## Separate runs ({reps} runs per schedule and scenario)",
            "",
        ]
        if paired_rounds
        else []
    )
    md = "\n".join(
        [
            *B.report_head(NAME, info, before, after),
            setup,
            "",
            *paired_part,
            table,
            "",
            "bubble: idle fraction of all stages over the step (from --trace); compute ms: forwards and "
            "backwards of one step, every rank together (the same math on both sides: more means the ranks "
            "got less of the cores); CPU s: user + system CPU "
            "seconds of a whole run, every rank (startup included; the same for both schedules); "
            "model ratio: the same comparison in a Monte-Carlo model of both policies with the measured "
            "per-stage times (stages never share a core there).",
            "",
        ]
        + [
            "## What the policy can gain (Monte-Carlo model, speedup over 1F1B)",
            "",
            what_if,
            "",
            "Same draws of compute times for every policy; 'bound': no order of any policy can beat the busiest "
            "stage's work plus the least pipeline fill and drain. '+2 in flight' holds 2 more microbatches' "
            "activations than 1F1B.",
            "",
        ]
        + [f"![{n} {k}]({pngs[(n, k)]})" for n in names for k in SCHEDULES]
    )
    payload = {
        "name": NAME,
        "command": B.command_line(),
        "machine": info,
        "load_before": before,
        "load_after": after,
        "config": {
            **attrs.asdict(cfg),
            "stages": stages,
            "stage_layers": split,
            "microbatches": microbatches,
            "reps": reps,
            "skip": skip,
            "emulation": envs["jitter"],
        },
        "results": results,
        "paired": paired_rounds,
    }
    md_path, _ = B.write_results(out_dir, NAME, md, payload)
    B.plot_pair_bars(
        results,
        (("1f1b", "#9c9c9c"), ("dynamic", "#4e79a7")),
        lambda r: r["scenario"],
        out_dir / f"{NAME}.png",
        f"dynamic vs 1F1B, {stages} stages ({info['cores']}-core CPU)",
    )
    print()
    if paired_rounds:
        print(paired_table)
        print()
    print(table)
    print()
    print(what_if)
    print()
    B.say(f"wrote {md_path}, {md_path.with_suffix('.json')}, {md_path.with_suffix('.png')} and timelines")


if __name__ == "__main__":
    main()
