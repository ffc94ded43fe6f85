"""Hot switching (HotSPa) against the best static layout that fits, on a long-tailed corpus, two CPU ranks.

Two computing ranks (gloo, one node), so the 2-core machine runs them without contention between more
ranks than cores. The corpus is the embedded grammar's documents with lognormal lengths (median
``--median`` tokens, log-std ``--sigma``): most documents are short, a few run up to ``seq_len``.
Every layout trains on packed documents with document masks (``data.packing = "documents"``), the
same documents in every run.

Memory cap: a layout must fit the longest rows (``seq_len`` positions) within a per-device cap on
*modelled* activation memory (``activation_bytes``: the block activations kept for backward of the
microbatches in flight, per device). The cap is set between what data parallelism needs (each device
holds every layer of its rows) and what TP 2 and PP 2 need (half), so DP 2 does not fit the long
documents and the static candidates are TP 2 and PP 2 (1F1B). Switching runs the short documents
under DP 2 (a bucket) and the long ones under the home layout (TP 2 or PP 2), which fits the cap.
The measured peak RSS of each run's largest process is reported beside it; on CPU it is dominated by
the runtime itself (a few hundred MB of torch), so it shows whether anything grew beyond the model,
not the activations to the MB.

Measured, interleaved in one run (static TP 2, static PP 2, switching over TP 2, switching over
PP 2, then again): tokens/s (median step after warm-up, over the real targets of the step), the
fraction of the step rank 0 spends in switches (its ``SWITCH`` trace actions, which include waiting
for the other rank to finish its bucket), each switch's own time (from the last rank entering it to
the last leaving it), and the time the planner's model predicts for it (``SwitchPlan.predict_seconds``)
from gloo's point-to-point latency and bandwidth probed on this host (``benchlib.p2p_probe``) and a
memory-copy bandwidth measured here.

    python bench/hot_switch.py
    python bench/hot_switch.py --quick
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import attrs
import click

import benchlib as B

NAME = "hot_switch"
FLOAT32 = 4


@attrs.frozen
class Config:
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    seq_len: int = 512
    global_batch: int = 8
    steps: int = 6
    warmup: int = 2
    short: int = 128  # the DP bucket's max_len
    median: float = 48.0
    sigma: float = 1.2
    rounds: int = 2


QUICK = Config(layers=2, hidden=32, heads=4, seq_len=64, global_batch=4, steps=3, warmup=1, short=16, median=8.0,
               rounds=1)


def common(cfg: Config) -> str:
    return "\n".join([
        "[model]", f"layers = {cfg.layers}", f"hidden = {cfg.hidden}", f"heads = {cfg.heads}", "vocab = 64",
        f"seq_len = {cfg.seq_len}",
        "", "[train]", f"steps = {cfg.steps}", f"global_batch = {cfg.global_batch}", "seed = 0", "lr = 1e-3",
        "warmup_steps = 1", "log_every = 1",
        "", "[data]", 'kind = "grammar"', 'packing = "documents"', f"doc_len_median = {cfg.median}",
        f"doc_len_sigma = {cfg.sigma}",
        "", "[cluster]", "timeout_s = 120", "[[cluster.nodes]]", 'name = "node0"', 'devices = ["cpu", "cpu"]', ""])


def home_toml(cfg: Config, kind: str) -> str:
    """TP 2 (one stage over both devices) or PP 2 (two stages, 1F1B); 2 microbatches per device either way."""
    half = cfg.layers // 2
    if kind == "tp2":
        return "\n".join(["[[pipelines]]", f"batch = {cfg.global_batch}", "microbatches = 2", "[[pipelines.stages]]",
                          f"layers = {cfg.layers}", 'devices = ["node0:0", "node0:1"]', ""])
    if kind == "pp2":
        return "\n".join(["[[pipelines]]", f"batch = {cfg.global_batch}", "microbatches = 4",
                          "[[pipelines.stages]]", f"layers = {half}", 'devices = ["node0:0"]',
                          "[[pipelines.stages]]", f"layers = {cfg.layers - half}", 'devices = ["node0:1"]', ""])
    raise ValueError(kind)


def buckets_toml(cfg: Config) -> str:
    """Short documents under DP 2 (a pipeline per device), the rest under the home layout."""
    lines = ["[[buckets]]", f"max_len = {cfg.short}"]
    for d in (0, 1):
        lines += ["[[buckets.pipelines]]", "batch = 1", "microbatches = 1", "[[buckets.pipelines.stages]]",
                  f"layers = {cfg.layers}", f'devices = ["node0:{d}"]']
    return "\n".join(lines + ["", "[[buckets]]", f"max_len = {cfg.seq_len}", ""])


LAYOUTS = {"static tp2": ("tp2", False), "static pp2": ("pp2", False),
           "switching dp2/tp2": ("tp2", True), "switching dp2/pp2": ("pp2", True)}


def activation_bytes(cfg: Config, kind: str) -> int:
    """Modelled activations kept for backward per device on the longest rows: per block ~16 (rows x width x
    hidden) float32 tensors (norms, q/k/v, attention output, MLP 4x), split by TP, times the layers a
    device holds, times the rows in flight (1F1B: up to the stages' count of microbatches)."""
    rows_per_mb = cfg.global_batch // (2 if kind in ("tp2", "dp2") else 4)
    per_layer = 16 * rows_per_mb * cfg.seq_len * cfg.hidden * FLOAT32
    if kind == "tp2":
        return per_layer * cfg.layers // 2
    if kind == "pp2":
        return per_layer * (cfg.layers // 2) * 2  # 2 microbatches in flight on the first stage
    if kind == "dp2":  # one pipeline per device: every layer of half the rows
        return per_layer * cfg.layers
    raise ValueError(kind)


def switch_times(trace: Path) -> tuple[list[float], list[float]]:
    """Per step (a step begins at its switch into bucket 0): the seconds rank 0 spent in SWITCH actions,
    waiting for the other rank included, and the switches' own time: for each switch, from the moment the
    last rank entered it to the moment the last rank left it (the ranks share one host's monotonic clock)."""
    from hetero_llm import trace as tracing

    switches = [[e for e in record["events"] if e["action"].startswith("SWITCH")]
                for record in tracing.read_rank_traces(trace)]
    if len({tuple(e["action"] for e in row) for row in switches}) != 1:
        raise RuntimeError(f"ranks of {trace} made different switches")
    rank0: list[float] = []
    own: list[float] = []
    for k, e in enumerate(switches[0]):
        if e["action"] == "SWITCH>b0":
            rank0.append(0.0)
            own.append(0.0)
        if rank0:
            rank0[-1] += float(e["end"]) - float(e["start"])
            own[-1] += max(float(row[k]["end"]) for row in switches) - max(float(row[k]["start"]) for row in switches)
    return rank0, own


def predicted_switch_seconds(layout: Path, trace: Path, latency: float, bandwidth: float, copy_bw: float,
                             per_block: float) -> list[float]:
    """The planner's predicted time of the switches each step of the trace made."""
    from hetero_llm import layout as layout_mod
    from hetero_llm import trace as tracing
    from hetero_llm.plan import compile_plan
    from hetero_llm.switch import bucket_plans, step_switch

    lay = layout_mod.load(layout)
    home = compile_plan(lay)
    plans = {"home": home, **{f"b{i}": p for i, p in enumerate(bucket_plans(lay)) if lay.buckets[i].pipelines}}
    events = tracing.read_rank_traces(trace)[0]["events"]
    steps: list[float] = []
    current, ran = "home", False
    for e in events:
        name = e["action"]
        if not name.startswith("SWITCH"):
            ran = ran or name[0] in "FBIW"
            continue
        target = name.split(">", 1)[1]
        if target == "b0":
            steps.append(0.0)
            current, ran = "home", False
        switch = step_switch(home, plans[current], plans[target], params=target != "home", grads=ran)
        steps[-1] += switch.predict_seconds(bandwidth, latency, copy_bw, per_block)
        current = target
    return steps


def copy_costs() -> tuple[float, float]:
    """(bytes/s of copying a few MB, seconds of host work per block) on this host: what a local switch
    block costs, and what cutting any block out of a shard and writing it into another costs besides
    its bytes (two narrows, a contiguous copy, an add: the switch's per-transfer work on a tiny block)."""
    import torch

    src, dst = torch.randn(1 << 20), torch.empty(1 << 20)
    big, small = [], []
    for _ in range(30):
        t0 = time.perf_counter()
        dst.copy_(src)
        big.append(time.perf_counter() - t0)
    for _ in range(200):
        t0 = time.perf_counter()
        block = src.narrow(0, 64, 32).contiguous()
        dst.narrow(0, 128, 32).add_(block)
        small.append(time.perf_counter() - t0)
    return 4 * (1 << 20) / B.median(big), B.median(small)


def launch_with_peak(layout: Path, workdir: Path, trace: Path | None) -> tuple[list[dict], int]:
    """``hetero-launch`` run inside a small wrapper process whose waited-for children are the launcher and its
    ranks, so the wrapper's children's peak RSS is this run's largest process (KiB)."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "hetero_llm.cli", str(layout), "--quiet", "--metrics-jsonl", str(metrics),
           "--set", f"cluster.port={B.free_port()}", *(["--trace", str(trace)] if trace else [])]
    wrapper = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(done.returncode)")
    proc = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, timeout=900,
                          env=B.clean_env(), cwd=B.ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return rows, int(proc.stdout.split()[-1])


def run_one(cfg: Config, name: str, folder: Path) -> dict:
    kind, switching = LAYOUTS[name]
    folder.mkdir(parents=True, exist_ok=True)
    layout = folder / (name.replace(" ", "_").replace("/", "_") + ".toml")
    layout.write_text(common(cfg) + home_toml(cfg, kind) + (buckets_toml(cfg) if switching else ""))
    trace = folder / (layout.stem + "_trace")
    rows, peak = launch_with_peak(layout, folder / layout.stem, trace if switching else None)
    steps = B.steady(rows, cfg.warmup)
    seconds = [r["seconds"] for r in steps]
    out = {"layout": name, "tokens_s": sum(r["tokens"] for r in steps) / sum(seconds),
           "step_s": B.median(seconds), "peak_rss_mb": peak / 1024, "layout_file": str(layout), "trace": str(trace)}
    if switching:
        waited, own = (B.steady(x, cfg.warmup) for x in switch_times(trace))
        out["switch_s"] = B.median(own)
        out["switch_waiting_s"] = B.median(waited)
        out["switch_fraction"] = out["switch_waiting_s"] / out["step_s"]
    return out


@click.command()
@click.option("--quick", is_flag=True, help="A tiny model and one round: checks the script end to end (seconds).")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=B.RESULTS, show_default=True)
def main(quick: bool, out_dir: Path) -> None:
    import tempfile

    cfg = QUICK if quick else Config()
    info, load_before = B.machine(), B.load_average()
    B.say(f"probing gloo point-to-point and memory copies on this host")
    latency, bandwidth = B.p2p_probe(reps=10 if quick else 50, big=1 << 20 if quick else 1 << 23)
    copy_bw, per_block = copy_costs()
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(cfg.rounds):
            order = list(LAYOUTS) if r % 2 == 0 else list(reversed(LAYOUTS))
            for name in order:
                B.say(f"round {r + 1}/{cfg.rounds}: {name}")
                result = run_one(cfg, name, Path(tmp) / f"r{r}")
                if LAYOUTS[name][1]:
                    predicted = B.steady(predicted_switch_seconds(Path(result["layout_file"]), Path(result["trace"]),
                                                                  latency, bandwidth, copy_bw, per_block),
                                           cfg.warmup)
                    result["predicted_switch_s"] = B.median(predicted)
                runs[name].append(result)
    load_after = B.load_average()
    cap = (activation_bytes(cfg, "dp2") + activation_bytes(cfg, "tp2")) // 2
    results = []
    for name, reps in runs.items():
        kind, switching = LAYOUTS[name]
        row = {"layout": name, "tokens_s": B.median([x["tokens_s"] for x in reps]),
               "step_s": B.median([x["step_s"] for x in reps]),
               "peak_rss_mb": max(x["peak_rss_mb"] for x in reps),
               "longest_rows_activation_mb": activation_bytes(cfg, kind) / 2**20,
               "fits_cap": activation_bytes(cfg, kind) <= cap}
        if switching:
            for key in ("switch_s", "switch_waiting_s", "switch_fraction", "predicted_switch_s"):
                row[key] = B.median([x[key] for x in reps])
            row["prediction_error"] = row["predicted_switch_s"] / row["switch_s"] - 1  # vs the switch's own time
        results.append(row)
    static = max((r for r in results if r["layout"].startswith("static") and r["fits_cap"]), key=lambda r: r["tokens_s"])
    for r in results:
        r["vs_best_static"] = r["tokens_s"] / static["tokens_s"]
    table = B.markdown_table(
        ["layout", "tokens/s", "x best static", "switch % of step", "switch s with wait", "switch s", "predicted s",
         "modelled act. MB", "fits cap", "peak RSS MB"],
        [[r["layout"], r["tokens_s"], r["vs_best_static"], 100 * r.get("switch_fraction", float("nan")),
          r.get("switch_waiting_s", float("nan")), r.get("switch_s", float("nan")),
          r.get("predicted_switch_s", float("nan")), r["longest_rows_activation_mb"],
          "yes" if r["fits_cap"] else "no", r["peak_rss_mb"]] for r in results])
    markdown = "\n".join([
        f"# Hot switching vs the best static layout ({'quick' if quick else 'full'})", "",
        f"`{B.command_line()}`", "",
        f"Model: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, seq_len {cfg.seq_len}, global batch "
        f"{cfg.global_batch} rows of packed documents (lognormal lengths, median {cfg.median:g} tokens, log-std "
        f"{cfg.sigma:g}); buckets: 1-{cfg.short} positions under DP 2, the rest under the home layout. Two computing "
        f"ranks (gloo, one node). Memory cap: {cap / 2**20:.1f} MB of modelled activations per device on the "
        f"longest rows (DP 2 would need {activation_bytes(cfg, 'dp2') / 2**20:.1f} MB).", "",
        table, "",
        f"Best static layout that fits: {static['layout']}. gloo p2p probed here: latency {latency * 1e6:.0f} us, "
        f"bandwidth {bandwidth / 1e9:.2f} GB/s; local copies {copy_bw / 1e9:.2f} GB/s, host work per block "
        f"{per_block * 1e6:.0f} us.", "",
        f"Machine: {B.machine_line(info)}; {B.load_line(load_before, load_after)}.", ""])
    payload = {"config": attrs.asdict(cfg), "machine": info, "load_before": load_before, "load_after": load_after,
               "p2p": {"latency_s": latency, "bandwidth_bytes_s": bandwidth, "copy_bytes_s": copy_bw,
                       "per_block_s": per_block},
               "cap_bytes": cap, "results": results, "runs": runs}
    md, js = B.write_results(out_dir, NAME, markdown, payload)
    plot(results, out_dir / f"{NAME}.png")
    print(markdown)
    B.say(f"wrote {md}, {js}")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 3.4), dpi=120)
    colors = ["#7a7a7a" if r["layout"].startswith("static") else "#2b7bba" for r in results]
    ax.bar(range(len(results)), [r["tokens_s"] for r in results], color=colors)
    for i, r in enumerate(results):
        ax.text(i, r["tokens_s"] * 1.02, f"{r['vs_best_static']:.2f}x", ha="center", fontsize=8)
    ax.set_xticks(range(len(results)), [r["layout"].replace("switching ", "switch\n") for r in results], fontsize=8)
    ax.set_ylabel("tokens / s (median)")
    ax.set_title("hot switching vs static layouts (2 CPU ranks)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
