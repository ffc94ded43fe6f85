"""GPU benchmark: hetero_llm's stage runtime against a plain PyTorch training loop, bf16, one GPU.

Single-stage training of a GPT-style model (LayerNorm, learned positions, GELU, untied head,
vocabulary 50304) at ~124M (12 layers, hidden 768, 12 heads) and ~1.3B (24 layers, hidden 2048,
16 heads) parameters, at sequence lengths 1024 and 2048, in the same process on the same GPU:

- **ours**: ``hetero_llm.train.rank.train`` on a one-rank layout with ``train.precision = "bf16"``
  (bf16 compute from float32 master weights, fused AdamW), eager or ``train.compile = "blocks"``;
- **plain**: an ``nn.Module`` of the same architecture and math (fused QKV linear, SDPA), AdamW
  fused, ``torch.autocast(bfloat16)``, global-norm clipping, eager or ``torch.compile(model)``.

Both read the same batches (``data.global_batch`` over a synthetic byte corpus: the grammar
generator costs tens of milliseconds of host time per step, which would swamp a GPU step) and both
sync the host once per step for the logged loss. Reported per run: median step time after the
warm-up steps, tokens/s, MFU and peak memory; and ours/plain (tokens/s).

MFU = model FLOPs per second / the GPU's dense bf16 peak. Model FLOPs per token are
``6 * N + 12 * layers * hidden * seq`` (PaLM's convention: N counts the weights that multiply, i.e.
without the embedding tables but with the head; attention scores and values at the full sequence,
not halved for the causal mask). Peaks (dense, no sparsity; NVIDIA datasheets): H100 SXM and H200
989 TFLOP/s, H100 NVL and H200 NVL 835, H100 PCIe 756, A100 312; ``--peak-tflops`` for others.

Then two multi-rank layouts on the same one GPU with backend gloo (NCCL refuses two ranks on one
GPU; gloo's p2p goes through host memory): two pipeline stages, and one stage of TP size 2. Each is
run twice through ``hetero-launch``: once for throughput, once with ``--trace`` for the step-time
breakdown per rank (forward, backward, sends, receives incl. waiting, and the rest: gradient sync,
optimizer, data). Tracing synchronizes the device after every action, so its times are device times.
``--tiny`` runs each once, traced, and takes the throughput from that run.

Then hot switching's switch on CUDA (``--switch``, ``bench/gpu/gpu_switch.py``): a [[buckets]] layout of the first
case's model (home TP 2, short documents under DP 2) on the one GPU over gloo, or on two GPUs over NCCL where there
are two, traced: the time of a step's switches and the bytes they move.

    python -m bench.gpu.gpu_bench                          # on a GPU machine: all of the above
    python -m bench.gpu.gpu_bench --models 124m --seqs 1024 --modes eager
    python -m bench.gpu.gpu_bench --tiny --device cpu      # smoke test: tiny model on CPU, minutes

Results: ``bench/results/gpu_bench.md`` (tables) and ``.json`` (every number); ``--tiny`` writes
``gpu_bench_tiny.*``.

The model sizes, cases and our layouts are ``bench/gpu/gpu_bench_cases.py``; the single-stage runs (ours and plain)
``bench/gpu/gpu_bench_runs.py``; this module runs the multi-rank layouts and writes the report.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import click
import torch

from bench.common import benchlib
from bench.gpu import gpu_switch
from bench.gpu.gpu_bench_cases import SIZES, Case, layout_toml
from bench.gpu.gpu_bench_runs import Run, World, run_ours, run_plain
from hetero_llm.comm import groups
from hetero_llm.predict import trace as tracing

# Dense bf16 tensor-core peaks in TFLOP/s (NVIDIA datasheets; the "with sparsity" figures are twice
# these). Matched against torch.cuda.get_device_name() in order: the first substring found wins.
PEAK_BF16_TFLOPS = (
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 312.0),
)


# ------------------------------------------------------------------------------------------
# Multi-rank layouts on one device, through hetero-launch


def step_breakdown(trace_dir: Path, warmup: int) -> list[dict]:
    """Per rank: mean seconds per steady step in F, B, SEND, RECV (posting + waiting) and the rest.

    A step starts at each occurrence of the rank's first forward action (every schedule starts a
    step with the forward of microbatch 0); the rest of a step is its span minus the actions in it.
    """
    labels, rows = tracing.rank_rows(tracing.read_rank_traces(trace_dir))
    out = []
    for label, row in zip(labels, rows):
        first_f = next(a for a, _, _ in row if tracing.action_kind(a) == "F")
        starts = [i for i, (a, _, _) in enumerate(row) if a == first_f]
        steps = []
        for n, i in enumerate(starts):
            j = starts[n + 1] if n + 1 < len(starts) else len(row)
            span_end = row[j][1] if j < len(row) else row[-1][2]
            sums = {"F": 0.0, "B": 0.0, "SEND": 0.0, "RECV": 0.0}
            for a, s, e in row[i:j]:
                kind = tracing.action_kind(a)
                key = kind if kind in ("F", "B") else kind.split("_")[0]
                sums[key] = sums.get(key, 0.0) + (e - s)
            sums["step"] = span_end - row[i][1]
            sums["other"] = sums["step"] - sum(sums[k] for k in ("F", "B", "SEND", "RECV"))
            steps.append(sums)
        steady = benchlib.steady(steps, warmup)
        out.append({"rank": label, **{k: statistics.mean(s[k] for s in steady) for k in steady[0]}})
    return out


def run_multi_rank(
    name: str,
    case: Case,
    device: str,
    steps: int,
    warmup: int,
    corpus: Path,
    workdir: Path,
    *,
    stages: int = 1,
    tp: int = 1,
    microbatches: int = 1,
    timed_untraced: bool = True,
) -> tuple[dict, list[dict]]:
    """``stages`` stages of one rank each, or one stage of TP size ``tp``; every rank on ``device``.
    The step time comes from a run of its own unless ``timed_untraced`` is off (``--tiny``: the traced run's)."""
    path = workdir / f"{name.split(',')[0].replace(' ', '_')}.toml"
    devices = [device] * (stages if stages > 1 else tp)
    path.write_text(
        layout_toml(
            case, devices=devices, steps=steps, corpus=corpus, backend="gloo", stages=stages, microbatches=microbatches
        )
    )
    traced = workdir / f"{path.stem}_trace"
    rows = benchlib.run_layout(path, workdir / f"{path.stem}_run", timeout=1800) if timed_untraced else None
    traced_rows = benchlib.run_layout(path, workdir / f"{path.stem}_traced", trace=traced, timeout=1800)
    rows = rows or traced_rows
    seconds = benchlib.median(benchlib.steady([r["seconds"] for r in rows], warmup))
    summary = {
        "layout": name,
        "model": case.size.name,
        "seq": case.seq,
        "batch": case.batch,
        "ranks": len(devices),
        "step_s": seconds,
        "tokens_per_s": case.tokens / seconds,
        "final_loss": rows[-1]["loss"],
    }
    return summary, [{"layout": name, **b} for b in step_breakdown(traced, warmup)]


# ------------------------------------------------------------------------------------------
# Report


def gpu_info(device: torch.device, peak_override: float | None) -> dict:
    if device.type != "cuda":
        return {"name": "cpu", "peak_bf16_tflops": peak_override}
    name = torch.cuda.get_device_name(device)
    peak = peak_override or next((p for key, p in PEAK_BF16_TFLOPS if key in name), None)
    props = torch.cuda.get_device_properties(device)
    return {
        "name": name,
        "memory_gb": props.total_memory / 2**30,
        "peak_bf16_tflops": peak,
        "cuda": torch.version.cuda,
        "capability": f"{props.major}.{props.minor}",
    }


def single_row(case: Case, run: Run, warmup: int, peak: float | None) -> dict:
    step = benchlib.median(benchlib.steady(run.seconds, warmup))
    tps = case.tokens / step
    mfu = tps * case.flops_per_token() / (peak * 1e12) if peak else float("nan")
    return {
        "model": case.size.name,
        "params": case.params,
        "seq": case.seq,
        "batch": case.batch,
        "mode": run.mode,
        "impl": run.impl,
        "step_s": step,
        "tokens_per_s": tps,
        "mfu": mfu,
        "peak_gb": run.peak_gb,
        "final_loss": run.final_loss,
        "step_seconds": run.seconds,
    }


def report(
    info: dict,
    single: list[dict],
    multi: list[dict],
    breakdown: list[dict],
    config: dict,
    from_trace: bool = False,
    switch: dict | None = None,
) -> str:
    lines = [
        "# GPU benchmark: hetero_llm vs plain PyTorch (bf16, one device)",
        "",
        f"`{benchlib.command_line()}`",
        "",
        f"Device: {info['name']}"
        + (f" ({info['memory_gb']:.0f} GiB, CUDA {info['cuda']})" if "cuda" in info else "")
        + f"; peak used for MFU: {info['peak_bf16_tflops'] or 'n/a'} TFLOP/s dense bf16; "
        f"torch {torch.__version__}; {config['steps']} steps, median after {config['warmup']} warm-up steps.",
        "",
        "## Single stage",
        "",
    ]
    headers = ["model", "seq", "batch", "mode", "impl", "step ms", "tokens/s", "MFU", "peak GiB", "ours/plain"]
    rows = []
    for r in single:
        ratio = ""
        if r["impl"] == "ours":
            plain = next(
                (
                    p
                    for p in single
                    if p["impl"] == "plain" and (p["model"], p["seq"], p["mode"]) == (r["model"], r["seq"], r["mode"])
                ),
                None,
            )
            ratio = f"{r['tokens_per_s'] / plain['tokens_per_s']:.3f}" if plain else ""
        rows.append(
            [
                r["model"],
                r["seq"],
                r["batch"],
                r["mode"],
                r["impl"],
                r["step_s"] * 1e3,
                f"{r['tokens_per_s']:,.0f}",
                "n/a" if r["mfu"] != r["mfu"] else f"{100 * r['mfu']:.1f}%",
                r["peak_gb"],
                ratio,
            ]
        )
    lines += [benchlib.markdown_table(headers, rows), ""]
    if multi:
        lines += [
            "## Several ranks on the one device (backend gloo, p2p staged through host memory)",
            "",
            *(["Step times from the traced runs below (`--tiny`: one run per layout).", ""] if from_trace else []),
            benchlib.markdown_table(
                ["layout", "model", "seq", "batch", "ranks", "step ms", "tokens/s"],
                [
                    [
                        m["layout"],
                        m["model"],
                        m["seq"],
                        m["batch"],
                        m["ranks"],
                        m["step_s"] * 1e3,
                        f"{m['tokens_per_s']:,.0f}",
                    ]
                    for m in multi
                ],
            ),
            "",
            "Step-time breakdown from `--trace` (ms per steady step; RECV includes waiting for the peer; "
            "other = gradient sync, optimizer, data; tracing synchronizes after every action):",
            "",
            benchlib.markdown_table(
                ["layout", "rank", "step", "F", "B", "SEND", "RECV", "other"],
                [
                    [b["layout"], b["rank"]] + [b[k] * 1e3 for k in ("step", "F", "B", "SEND", "RECV", "other")]
                    for b in breakdown
                ],
            ),
            "",
        ]
    if switch is not None:
        lines += gpu_switch.report(switch)
    return "\n".join(lines)


def _csv(kind):
    return lambda ctx, param, value: [kind(v) for v in value.split(",")] if value else None


@click.command()
@click.option("--device", default="cuda", show_default=True, help="cuda (or cuda:N) or cpu.")
@click.option(
    "--tiny", is_flag=True, help="Tiny model, short sequences, few steps: a smoke test (e.g. with --device cpu)."
)
@click.option("--models", callback=_csv(str), default=None, help="Comma list of: 124m, 1.3b, tiny.")
@click.option("--seqs", callback=_csv(int), default=None, help="Comma list of sequence lengths.")
@click.option("--modes", callback=_csv(str), default=None, help="Comma list of: eager, compiled.")
@click.option("--tokens-per-step", type=int, default=None, help="Tokens per step (batch = tokens / seq).")
@click.option("--steps", type=int, default=None)
@click.option("--warmup", type=int, default=None, help="Steps left out of the medians (compilation happens here).")
@click.option(
    "--multi-rank/--no-multi-rank",
    default=True,
    show_default=True,
    help="Also the 2-stage and TP-2 layouts on the one device.",
)
@click.option(
    "--switch/--no-switch",
    default=True,
    show_default=True,
    help="Also hot switching's switch (bench/gpu/gpu_switch.py).",
)
@click.option("--peak-tflops", type=float, default=None, help="Dense bf16 peak of this GPU, if not in the table.")
@click.option("--out", type=click.Path(file_okay=False), default=str(benchlib.RESULTS), show_default=True)
def main(device, tiny, models, seqs, modes, tokens_per_step, steps, warmup, multi_rank, switch, peak_tflops, out):
    """Benchmark hetero_llm against plain PyTorch on one GPU (see the module doc)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("CUDA is not available here (use --device cpu, e.g. with --tiny)")
    if dev.type == "cuda":  # torch 2.11 refuses set_device("cuda") without an index
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(dev)
    models = models or (["tiny"] if tiny else ["124m", "1.3b"])
    seqs = seqs or ([32, 64] if tiny else [1024, 2048])
    modes = modes or (["eager"] if tiny else ["eager", "compiled"])
    tokens_per_step = tokens_per_step or (128 if tiny else 16384)
    steps = steps or (5 if tiny else 20)
    warmup = warmup if warmup is not None else (2 if tiny else 6)
    for m in models:
        if m not in SIZES:
            raise click.UsageError(f"unknown model '{m}' (choose from {', '.join(SIZES)})")
    for m in modes:
        if m not in ("eager", "compiled"):
            raise click.UsageError(f"unknown mode '{m}' (choose from eager, compiled)")
    info = gpu_info(dev, peak_tflops)
    workdir = Path(tempfile.mkdtemp(prefix="gpu_bench_"))
    try:
        corpus = workdir / "corpus.txt"
        corpus.write_bytes(os.urandom(32 << 20 if not tiny else 1 << 20))  # bytes: the text source's tokens
        config = {
            "models": models,
            "seqs": seqs,
            "modes": modes,
            "tokens_per_step": tokens_per_step,
            "steps": steps,
            "warmup": warmup,
            "device": str(dev),
        }
        benchlib.say(f"{info['name']}: {config}")

        single, world = [], World(dev)
        # Untimed: the first run in a process pays for the CUDA context, library handles and kernel caches.
        run_plain(Case(SIZES[models[0]], seqs[0], max(1, tokens_per_step // seqs[0])), "eager", 2, dev, corpus)
        for name in models:
            for seq in seqs:
                case = Case(SIZES[name], seq, max(1, tokens_per_step // seq))
                for mode in modes:
                    for runner in (run_ours, run_plain):  # same GPU, same process, one after the other
                        run = (
                            runner(case, mode, steps, dev, corpus, world)
                            if runner is run_ours
                            else runner(case, mode, steps, dev, corpus)
                        )
                        row = single_row(case, run, warmup, info["peak_bf16_tflops"])
                        single.append(row)
                        benchlib.say(
                            f"{name} seq {seq} {mode} {run.impl}: {row['step_s'] * 1e3:.1f} ms/step, "
                            f"{row['tokens_per_s']:,.0f} tokens/s, peak {row['peak_gb']:.1f} GiB"
                        )
        multi, breakdown, switched = [], [], None
        if multi_rank or switch:
            groups.shutdown()  # the children make their own process groups; this one is done
        if multi_rank:
            case = Case(SIZES[models[0]], seqs[0], max(4, tokens_per_step // seqs[0]))
            dev_name = "cpu" if dev.type == "cpu" else f"cuda:{dev.index}"
            for name, kw in (
                ("2 stages, 1f1b, 4 microbatches", {"stages": 2, "microbatches": 4}),
                ("1 stage, TP 2", {"tp": 2}),
            ):
                summary, parts = run_multi_rank(
                    name, case, dev_name, steps, warmup, corpus, workdir, timed_untraced=not tiny, **kw
                )
                multi.append(summary)
                breakdown += parts
                benchlib.say(f"{name}: {summary['step_s'] * 1e3:.1f} ms/step, {summary['tokens_per_s']:,.0f} tokens/s")
        if switch:
            case = Case(SIZES[models[0]], seqs[0], max(4, tokens_per_step // seqs[0]))
            switched = gpu_switch.measure(case, dev, steps, warmup, workdir)
            benchlib.say(f"switch: {switched['switch_s'] * 1e3:.2f} ms a step over {switched['backend']}")
    finally:  # the corpus and the runs' folders: results go to --out
        shutil.rmtree(workdir, ignore_errors=True)
    markdown = report(info, single, multi, breakdown, config, from_trace=tiny, switch=switched)
    payload = {
        "device": info,
        "torch": torch.__version__,
        "config": config,
        "single_stage": single,
        "multi_rank": multi,
        "breakdown": breakdown,
        "switch": switched,
        "machine": benchlib.machine(),
    }
    md, js = benchlib.write_results(Path(out), "gpu_bench_tiny" if tiny else "gpu_bench", markdown, payload)
    print(markdown)
    benchlib.say(f"wrote {md} and {js}")


if __name__ == "__main__":
    sys.exit(main())
