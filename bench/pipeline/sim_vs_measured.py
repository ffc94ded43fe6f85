"""How well does the cost-model simulator predict real steps? Measured vs predicted, per layout and schedule.

For each layout (2-4 stages, uneven layers; gpipe, 1f1b, interleaved, zero-bubble zbh1) this script

1. trains it with ``hetero-launch --trace`` (CPU, gloo, one process per stage);
2. reads per-stage forward and backward times from the trace (median over the steps after the
   first; the runtime traces input waits as separate ``RECV`` records, so ``F``/``B`` are compute;
   a split backward's ``I`` and ``W`` are read separately and give the cost model its ``weight``);
3. measures gloo's point-to-point latency and bandwidth on this host (ping-pong of one element and
   of one boundary activation);
4. feeds both into ``simulate.CostModel`` and ``simulate.simulate`` with the layout's own action
   lists, and compares the predicted step time and bubble fraction with the measured ones.

The measured pipeline time is the span of a step's actions over all ranks (first action's start
to last action's end): the part the simulator models. The full step time from ``--metrics-jsonl``
(which adds gradient sync, clipping and AdamW) is listed beside it.

    python -m bench.pipeline.sim_vs_measured
    python -m bench.pipeline.sim_vs_measured --quick
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import attrs
import click

from bench.common import benchlib as B
from bench.common.traces import bubble_fraction, compute_intervals, step_span, trace_steps

NAME = "sim_vs_measured"


@attrs.frozen
class Case:
    stage_layers: tuple[int, ...]
    schedule: str
    chunks: int = 1

    @property
    def label(self) -> str:
        extra = f" x{self.chunks} chunks" if self.chunks > 1 else ""
        return f"{len(self.stage_layers)} stages {list(self.stage_layers)}{extra}"

    @property
    def slug(self) -> str:
        return f"s{'-'.join(map(str, self.stage_layers))}_{self.schedule}{self.chunks if self.chunks > 1 else ''}"


CASES = (
    Case((3, 5), "gpipe"),
    Case((3, 5), "1f1b"),
    Case((2, 6), "interleaved", 2),
    Case((2, 3, 3), "1f1b"),
    Case((1, 2, 3, 2), "gpipe"),
    Case((1, 2, 3, 2), "1f1b"),
    Case((2, 2, 2, 2), "interleaved", 2),
    Case((3, 5), "zbh1"),
    Case((1, 2, 3, 2), "zbh1"),
)
QUICK_CASES = (Case((1, 1), "1f1b"), Case((1, 1), "zbh1"))


def stage_times(steps, num_stages: int, chunks: int, average=B.median) -> dict[str, list[float]]:
    """Per action kind present (``F``, ``B``, or ``I`` and ``W``) and stage: seconds of one microbatch through
    all the stage's chunks (``average`` of each chunk's records, summed over chunks)."""
    samples: dict[tuple[str, int, int], list[float]] = {}
    for step in steps:
        for stage, row in enumerate(compute_intervals(step, chunks)):
            for action, start, end in row:
                chunk = int(action.split(".")[1]) if "." in action else 0
                samples.setdefault((action[0], stage, chunk), []).append(end - start)
    kinds = sorted({kind for kind, _, _ in samples})
    return {
        kind: [sum(average(samples.get((kind, s, c), [0.0])) for c in range(chunks)) for s in range(num_stages)]
        for kind in kinds
    }


def backward_and_weight(times: dict[str, list[float]]) -> tuple[list[float], list[float] | None]:
    """The cost model's ``backward`` (a full one: B, or I + W) and ``weight`` (W; None without a split)."""
    if "I" in times:
        return [i + w for i, w in zip(times["I"], times["W"])], times["W"]
    return times["B"], None


def mean(values) -> float:
    return sum(values) / len(values)


def action_overhead(steps) -> list[float]:
    """Per stage: mean seconds per compute action the rank spends outside compute and outside waiting
    for data: posting sends and receives, and the interpreter between records (the gaps).

    A receive is recorded twice, when posted and when waited for; only the wait is waiting.
    """
    per_stage: list[list[float]] = [[] for _ in steps[0]]
    for step in steps:
        for stage, row in enumerate(step):
            seen: set[str] = set()
            busy = waits = 0.0
            computes = 0
            for action, start, end in row:
                if action[0] in "FBIW":
                    busy += end - start
                    computes += 1
                elif action.startswith("RECV") and action in seen:
                    waits += end - start
                seen.add(action)
            span = row[-1][2] - row[0][1]
            per_stage[stage].append(max(0.0, span - busy - waits) / max(computes, 1))
    return [B.median(v) for v in per_stage]


def plot_errors(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2 + 1.25 * len(results), 3.8), dpi=120)
    x = range(len(results))
    w = 0.38
    measured = [r["measured_ms"] for r in results]
    predicted = [r["predicted_ms"] for r in results]
    ax.bar([i - w / 2 for i in x], measured, w, label="measured (trace span)", color="#4e79a7")
    ax.bar([i + w / 2 for i in x], predicted, w, label="simulated", color="#f28e2b")
    for i, r in enumerate(results):
        ax.text(i, max(measured[i], predicted[i]) * 1.02, f"{r['error_pct']:+.0f}%", ha="center", fontsize=8)
    ax.set_xticks(list(x), [f"{r['stages']}st {r['schedule']}\n{r['stage_layers']}" for r in results], fontsize=7)
    ax.set_ylabel("pipeline time per step (ms)")
    ax.set_ylim(0, max(measured + predicted) * 1.18)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--steps", default=8, show_default=True)
@click.option("--skip", default=1, show_default=True, help="Warm-up steps left out of the medians.")
@click.option("--layers", default=8, show_default=True)
@click.option("--hidden", default=128, show_default=True)
@click.option("--seq-len", default=128, show_default=True)
@click.option("--batch", default=16, show_default=True)
@click.option("--microbatches", default=8, show_default=True)
@click.option("--quick", is_flag=True, help="Smoke run: one 2-stage layout, tiny model, 3 steps.")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=B.RESULTS, show_default=True)
def main(steps, skip, layers, hidden, seq_len, batch, microbatches, quick, out_dir):
    """Simulated vs measured step time and bubble, per layout and schedule."""
    from hetero_llm import layout as layout_mod
    from hetero_llm.plan import compile_plan
    from hetero_llm.predict.simulate import CostModel, simulate
    from hetero_llm.predict.timeline import plot_timeline

    cfg = B.ModelConfig(layers=layers, hidden=hidden, seq_len=seq_len, global_batch=batch, steps=steps)
    cases = CASES
    if quick:
        cases, skip, microbatches = QUICK_CASES, 1, 2
        cfg = B.ModelConfig(layers=2, hidden=32, heads=4, vocab=64, seq_len=16, global_batch=4, steps=3)
    info, before = B.machine(), B.load_average()
    B.say(f"{NAME}: {B.machine_line(info)}; load {before[0]:.2f}")
    mb_rows = cfg.global_batch // microbatches
    act_numel = mb_rows * cfg.seq_len * cfg.hidden
    latency, bandwidth = B.p2p_probe(reps=10 if quick else 50, big=1 << 16 if quick else 1 << 20, fork=quick)
    B.say(
        f"gloo p2p here: latency {latency * 1e6:.0f} us, bandwidth {bandwidth / 1e9:.2f} GB/s "
        f"(activation {4 * act_numel / 1e3:.0f} kB: {(latency + 4 * act_numel / bandwidth) * 1e6:.0f} us)"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_sim_") as tmp:
        for index, case in enumerate(cases):
            path = Path(tmp, f"{case.slug}.toml")
            path.write_text(B.layout_toml(cfg, case.stage_layers, microbatches, case.schedule, chunks=case.chunks))
            work = Path(tmp, case.slug)
            rows = B.run_layout(path, work, trace=work / "trace")
            traced = B.steady(trace_steps(work / "trace"), skip)
            S = len(case.stage_layers)
            times = stage_times(traced, S, case.chunks)
            fwd, (bwd, weight) = times["F"], backward_and_weight(times)
            links = S if case.chunks > 1 else S - 1
            plan = compile_plan(layout_mod.load(path))

            def predict(forward, backward, weight, overhead=None):
                return simulate(
                    plan.schedules[0],  # noqa: B023 (predict is called in this iteration)
                    CostModel(
                        forward=forward,
                        backward=backward,
                        latency=[latency] * links,  # noqa: B023
                        bandwidth=[bandwidth] * links,  # noqa: B023
                        activation_bytes=4 * act_numel,
                        weight=weight,
                        overhead=overhead,
                    ),
                )

            sim = predict(fwd, bwd, weight)
            # what the median misses: the mean of skewed compute times, then the per-action runtime cost
            times_mean = stage_times(traced, S, case.chunks, average=mean)
            fwd_mean, (bwd_mean, weight_mean) = times_mean["F"], backward_and_weight(times_mean)
            sim_mean = predict(fwd_mean, bwd_mean, weight_mean)
            overhead = action_overhead(traced)
            sim_over = predict(fwd_mean, bwd_mean, weight_mean, overhead)
            measured = B.median([step_span(s) for s in traced])
            step_s = B.median(B.steady([r["seconds"] for r in rows], skip))
            bubble = B.median([bubble_fraction(s, case.chunks) for s in traced])
            r = {
                "layout": case.label,
                "stages": S,
                "stage_layers": list(case.stage_layers),
                "schedule": case.schedule,
                "chunks": case.chunks,
                "measured_ms": measured * 1e3,
                "predicted_ms": sim.step_time * 1e3,
                "error_pct": 100 * (sim.step_time - measured) / measured,
                "measured_bubble": bubble,
                "predicted_bubble": sim.mean_bubble,
                "step_ms": step_s * 1e3,
                "predicted_mean_ms": sim_mean.step_time * 1e3,
                "error_mean_pct": 100 * (sim_mean.step_time - measured) / measured,
                "predicted_overhead_ms": sim_over.step_time * 1e3,
                "error_overhead_pct": 100 * (sim_over.step_time - measured) / measured,
                "action_overhead_ms": [o * 1e3 for o in overhead],
                "stage_forward_ms": [f * 1e3 for f in fwd],
                "stage_backward_ms": [b * 1e3 for b in bwd],
                "stage_weight_ms": [w * 1e3 for w in weight] if weight is not None else None,
            }
            results.append(r)
            B.say(
                f"[{index + 1}/{len(cases)}] {case.label} {case.schedule}: measured {r['measured_ms']:.1f} ms, "
                f"predicted {r['predicted_ms']:.1f} ms ({r['error_pct']:+.1f}%), bubble {bubble:.1%} vs "
                f"{sim.mean_bubble:.1%} (load {B.load_average()[0]:.2f})"
            )
            if index == len(cases) - 1 or case == Case((1, 2, 3, 2), "1f1b"):
                step = traced[min(1, len(traced) - 1)]
                plot_timeline(
                    step, out_dir / f"{NAME}_{case.slug}_measured.png", f"measured: {case.label}, {case.schedule}"
                )
                plot_timeline(
                    sim.rows(),
                    out_dir / f"{NAME}_{case.slug}_simulated.png",
                    f"simulated: {case.label}, {case.schedule}",
                )
                r["timelines"] = [f"{NAME}_{case.slug}_measured.png", f"{NAME}_{case.slug}_simulated.png"]
    after = B.load_average()
    headers = [
        "layout",
        "schedule",
        "measured ms",
        "predicted ms",
        "error %",
        "bubble measured",
        "bubble predicted",
        "full step ms",
        "F ms per stage",
        "B ms per stage",
    ]
    table = B.markdown_table(
        headers,
        [
            [
                r["layout"],
                r["schedule"],
                f"{r['measured_ms']:.1f}",
                f"{r['predicted_ms']:.1f}",
                f"{r['error_pct']:+.1f}",
                f"{r['measured_bubble']:.1%}",
                f"{r['predicted_bubble']:.1%}",
                f"{r['step_ms']:.1f}",
                " / ".join(f"{x:.1f}" for x in r["stage_forward_ms"]),
                " / ".join(f"{x:.1f}" for x in r["stage_backward_ms"]),
            ]
            for r in results
        ],
    )
    errors = [abs(r["error_pct"]) for r in results]
    summary = f"mean |error| {sum(errors) / len(errors):.1f}%, max |error| {max(errors):.1f}%"
    decomposition = B.markdown_table(
        [
            "layout",
            "schedule",
            "measured ms",
            "error: median F/B",
            "error: mean F/B",
            "error: mean F/B + runtime",
            "runtime ms per action (per stage)",
        ],
        [
            [
                r["layout"],
                r["schedule"],
                f"{r['measured_ms']:.1f}",
                f"{r['error_pct']:+.1f}%",
                f"{r['error_mean_pct']:+.1f}%",
                f"{r['error_overhead_pct']:+.1f}%",
                " / ".join(f"{x:.2f}" for x in r["action_overhead_ms"]),
            ]
            for r in results
        ],
    )
    setup = (
        f"model: GPT {cfg.layers} layers, hidden {cfg.hidden}, seq {cfg.seq_len}; global batch {cfg.global_batch}, "
        f"{microbatches} microbatches; {cfg.steps} steps, medians over steps {skip + 1}..; gloo p2p "
        f"latency {latency * 1e6:.0f} us, bandwidth {bandwidth / 1e9:.2f} GB/s, activation "
        f"{4 * act_numel / 1e3:.0f} kB"
    )
    timelines = [png for r in results for png in r.get("timelines", [])]
    md = "\n".join(
        [
            *B.report_head(NAME, info, before, after),
            setup,
            "",
            table,
            "",
            summary,
            "",
            "Where the error comes from: the same simulation fed with the mean instead of the median F/B time "
            "(compute times on a shared host are skewed: a few slow ones), and then with each action's "
            "runtime cost added (posting sends and receives and the interpreter between actions, per compute "
            "action, from the trace):",
            "",
            decomposition,
            "",
            "measured ms: span of one step's actions over all ranks (median); predicted: simulate() with the "
            "measured per-stage F/B times and the p2p estimate; full step: --metrics-jsonl seconds (adds "
            "gradient sync, clipping, AdamW); B ms for zbh1: its I + W.",
            "",
        ]
        + [f"![{png}]({png})" for png in timelines]
    )
    payload = {
        "name": NAME,
        "command": B.command_line(),
        "machine": info,
        "load_before": before,
        "load_after": after,
        "p2p": {"latency_s": latency, "bandwidth_bytes_s": bandwidth, "activation_bytes": 4 * act_numel},
        "config": {**attrs.asdict(cfg), "microbatches": microbatches, "skip": skip},
        "results": results,
    }
    md_path, _ = B.write_results(out_dir, NAME, md, payload)
    plot_errors(results, out_dir / f"{NAME}.png", f"simulator vs measured ({info['cores']}-core CPU, gloo)")
    print()
    print(table)
    print(summary)
    print()
    print(decomposition)
    print()
    B.say(f"wrote {md_path}, {md_path.with_suffix('.json')}, {md_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
