"""GPU benchmark: hetero_llm's stage runtime against a plain PyTorch training loop, bf16, one GPU.

Single-stage training of a GPT-style model (LayerNorm, learned positions, GELU, untied head,
vocabulary 50304) at ~124M (12 layers, hidden 768, 12 heads) and ~1.3B (24 layers, hidden 2048,
16 heads) parameters, at sequence lengths 1024 and 2048, in the same process on the same GPU:

- **ours**: ``hetero_llm.train.loop.train`` on a one-rank layout with ``train.precision = "bf16"``
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

    python -m bench.gpu_bench                          # on a GPU machine: all of the above
    python -m bench.gpu_bench --models 124m --seqs 1024 --modes eager
    python -m bench.gpu_bench --tiny --device cpu      # smoke test: tiny model on CPU, minutes

Results: ``bench/results/gpu_bench.md`` (tables) and ``.json`` (every number); ``--tiny`` writes
``gpu_bench_tiny.*``.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs
import click
import torch
import torch.nn as nn
import torch.nn.functional as F

from bench import benchlib
from hetero_llm import layout as layout_mod
from hetero_llm.comm import groups, shm
from hetero_llm.comm.groups import Comms
from hetero_llm.data import batches as data
from hetero_llm.model.params import count_params
from hetero_llm.plan import compile_plan
from hetero_llm.predict import trace as tracing
from hetero_llm.train.loop import train

VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 64, as nanoGPT does

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


@attrs.frozen
class Size:
    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int = VOCAB


SIZES = {s.name: s for s in (Size("124m", 12, 768, 12), Size("1.3b", 24, 2048, 16), Size("tiny", 2, 64, 4, 256))}


@attrs.frozen
class Case:
    size: Size
    seq: int
    batch: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def model_spec(self) -> layout_mod.ModelSpec:
        s = self.size
        return layout_mod.ModelSpec(layers=s.layers, hidden=s.hidden, heads=s.heads, vocab=s.vocab, seq_len=self.seq)

    @property
    def params(self) -> int:
        return count_params(self.model_spec())

    def flops_per_token(self) -> float:
        s = self.size
        matmul_weights = self.params - s.vocab * s.hidden - self.seq * s.hidden  # minus the embedding tables
        return 6 * matmul_weights + 12 * s.layers * s.hidden * self.seq


# ------------------------------------------------------------------------------------------
# Layouts (ours)


def layout_toml(
    case: Case,
    *,
    devices: list[str],
    steps: int,
    corpus: Path,
    compile_mode: str = "none",
    backend: str = "gloo",
    stages: int = 1,
    microbatches: int = 1,
) -> str:
    """One pipeline; ``stages`` stages of one rank each, or one stage over all ``devices`` (TP)."""
    s = case.size
    train = layout_mod.TrainSpec(
        steps=steps,
        global_batch=case.batch,
        seed=0,
        precision=layout_mod.Precision.BF16,
        compile=layout_mod.Compile(compile_mode),
        lr=3e-4,
        min_lr=3e-5,
        warmup_steps=2,
        weight_decay=0.1,
        grad_clip=1.0,
        log_every=1,
    )
    data = layout_mod.DataSpec(kind=layout_mod.DataKind.TEXT, path=str(corpus))
    # one node per rank: several ranks may share one GPU (gloo)
    nodes = tuple(layout_mod.NodeSpec(name=f"r{i}", devices=(dev,)) for i, dev in enumerate(devices))
    cluster = layout_mod.ClusterSpec(nodes=nodes, backend=layout_mod.Backend(backend), timeout_s=300.0)
    if stages > 1:
        specs = tuple(layout_mod.StageSpec(layers=s.layers // stages, devices=(f"r{i}:0",)) for i in range(stages))
    else:
        specs = (layout_mod.StageSpec(layers=s.layers, devices=tuple(f"r{i}:0" for i in range(len(devices)))),)
    pipeline = layout_mod.PipelineSpec(batch=case.batch, microbatches=microbatches, stages=specs)
    return layout_mod.dumps(
        layout_mod.Layout(
            file="<gpu_bench>", model=case.model_spec(), train=train, data=data, cluster=cluster, pipelines=(pipeline,)
        )
    )


@attrs.define
class World:
    """The one-rank process group the in-process runs of ours share (it can be created once)."""

    device: torch.device
    comms: Comms | None = None

    def get(self, plan) -> Comms:
        if self.comms is None:
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(benchlib.free_port())
            self.comms = groups.init(plan.rank_plan(0), self.device, shm.rank_rings(plan, 0))
        return self.comms


@attrs.frozen
class Run:
    impl: str  # "ours" | "plain"
    mode: str  # "eager" | "compiled"
    seconds: list[float]  # per step
    final_loss: float
    peak_gb: float


def _reset(device: torch.device) -> None:
    torch._dynamo.reset()  # a fresh compile cache per run (and no recompile limit across model sizes)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def run_ours(case: Case, mode: str, steps: int, device: torch.device, corpus: Path, world: World) -> Run:
    _reset(device)
    text = layout_toml(
        case,
        devices=[str(device)],
        steps=steps,
        corpus=corpus,
        compile_mode="blocks" if mode == "compiled" else "none",
        backend="nccl" if device.type == "cuda" else "gloo",
    )
    plan = compile_plan(layout_mod.loads(text, file="<gpu_bench>"))
    history = train(plan.rank_plan(0), world.get(plan), quiet=True, keep_history=True)
    return Run("ours", mode, [m.seconds for m in history], history[-1].loss, _peak_gb(device))


# ------------------------------------------------------------------------------------------
# The plain PyTorch baseline: same architecture and math, written the usual way.


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden, bias=False)
        self.fc_proj = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, size: Size, seq: int):
        super().__init__()
        self.tok = nn.Embedding(size.vocab, size.hidden)
        self.pos = nn.Embedding(seq, size.hidden)
        self.blocks = nn.ModuleList(Block(size.hidden, size.heads) for _ in range(size.layers))
        self.ln_f = nn.LayerNorm(size.hidden)
        self.head = nn.Linear(size.hidden, size.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * size.layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def run_plain(case: Case, mode: str, steps: int, device: torch.device, corpus: Path) -> Run:
    _reset(device)
    source = data.make_source(layout_mod.DataSpec(kind=layout_mod.DataKind.TEXT, path=str(corpus)), "<gpu_bench>")
    model = PlainGPT(case.size, case.seq).to(device)
    decay = [p for p in model.parameters() if p.dim() == 2 and p is not model.tok.weight and p is not model.pos.weight]
    other = [p for p in model.parameters() if all(p is not d for d in decay)]
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=cuda or None,
    )
    forward = torch.compile(model) if mode == "compiled" else model
    seconds, loss_value = [], float("nan")
    for step in range(steps):
        t0 = time.perf_counter()
        batch = torch.from_numpy(data.global_batch(source, 0, step, case.batch, case.seq))
        if cuda:
            batch = batch.pin_memory().to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()  # one host sync per step, as ours (for the logged loss)
        seconds.append(time.perf_counter() - t0)
    return Run("plain", mode, seconds, loss_value, _peak_gb(device))


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
    info: dict, single: list[dict], multi: list[dict], breakdown: list[dict], config: dict, from_trace: bool = False
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
@click.option("--peak-tflops", type=float, default=None, help="Dense bf16 peak of this GPU, if not in the table.")
@click.option("--out", type=click.Path(file_okay=False), default=str(benchlib.RESULTS), show_default=True)
def main(device, tiny, models, seqs, modes, tokens_per_step, steps, warmup, multi_rank, peak_tflops, out):
    """Benchmark hetero_llm against plain PyTorch on one GPU (see the module doc)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("CUDA is not available here (use --device cpu, e.g. with --tiny)")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        dev = torch.device("cuda", torch.cuda.current_device())
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
        multi, breakdown = [], []
        if multi_rank:
            groups.shutdown()  # the children make their own process groups; this one is done
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
    finally:  # the corpus and the runs' folders: results go to --out
        shutil.rmtree(workdir, ignore_errors=True)
    markdown = report(info, single, multi, breakdown, config, from_trace=tiny)
    payload = {
        "device": info,
        "torch": torch.__version__,
        "config": config,
        "single_stage": single,
        "multi_rank": multi,
        "breakdown": breakdown,
        "machine": benchlib.machine(),
    }
    md, js = benchlib.write_results(Path(out), "gpu_bench_tiny" if tiny else "gpu_bench", markdown, payload)
    print(markdown)
    benchlib.say(f"wrote {md} and {js}")


if __name__ == "__main__":
    sys.exit(main())
