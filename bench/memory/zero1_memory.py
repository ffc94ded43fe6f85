"""ZeRO-1 memory: optimizer-state bytes and peak process memory per rank, with and without ZeRO-1.

    python -m bench.memory.zero1_memory [--quick] [--out-dir bench/results]

For each layout, the same training runs twice (``train.optimizer = 'adamw'``, then ``'adamw_zero1'``), one
fresh Python process per rank (``benchlib.start_ranks``, gloo on CPU). Each rank reports:

- the bytes of AdamW moments it keeps, read from its optimizer's tensors, next to what the formula of
  ``hetero_llm.plan.zero1_slices.state_elements`` predicts (``8 x`` elements: two float32 moments);
- its peak resident memory (``VmHWM``) and its resident memory after imports, before training (``VmRSS``):
  the difference is what training added (parameters, gradients, moments, activations, buffers).

Writes ``zero1_memory.md`` (tables), ``zero1_memory.json`` and ``zero1_memory.png`` (bars) to ``--out-dir``.
A memory measurement, not a timing: the ranks may share the cores.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.common import benchlib
from hetero_llm import layout as L

# (name, pipelines [(batch, microbatches, [(layers, tp), ...])])
LAYOUTS = [
    ("2 pipelines, tp 1 and tp 1", [(4, 2, [(4, 1)]), (4, 2, [(4, 1)])]),
    ("tp 2 beside tp 1", [(4, 2, [(4, 2)]), (4, 2, [(4, 1)])]),
]
OPTIMIZERS = ("adamw", "adamw_zero1")


def optimizer_layout(file: str, pipelines, hidden: int, layers: int, steps: int, optimizer: str) -> L.Layout:
    """``pipelines`` [(batch, microbatches, [(layers, tp), ...])], each on a node of its own (``n0``, ``n1``, ...)
    whose CPU devices its stages use in order, trained with ``optimizer``."""
    model = L.ModelSpec(layers=layers, hidden=hidden, heads=8, vocab=256, seq_len=32)
    train = L.TrainSpec(steps=steps, global_batch=8, optimizer=L.Optimizer(optimizer))
    nodes, pipes = [], []
    for pi, (batch, mbs, stages) in enumerate(pipelines):
        nodes.append(L.NodeSpec(name=f"n{pi}", devices=("cpu",) * sum(t for _, t in stages)))
        specs, d = [], 0
        for n, tp in stages:
            specs.append(L.StageSpec(layers=n, devices=tuple(f"n{pi}:{d + i}" for i in range(tp))))
            d += tp
        pipes.append(L.PipelineSpec(batch=batch, microbatches=mbs, stages=tuple(specs)))
    return L.Layout(
        file=file,
        model=model,
        train=train,
        data=L.DataSpec(),
        cluster=L.ClusterSpec(nodes=tuple(nodes), timeout_s=120.0),
        pipelines=tuple(pipes),
    )


def _kib(line: str) -> int:
    return int(line.split()[1]) * 1024


def status_bytes(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return _kib(line)
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(out: str, argv: list[str]) -> None:
    """One rank: run ``hetero-launch ARGV`` and write what it kept to ``out``/rank{R}.json."""
    from hetero_llm import layout as layout_mod
    from hetero_llm.cli import launch
    from hetero_llm.layout import Optimizer
    from hetero_llm.plan import compile_plan, zero1_slices
    from hetero_llm.runtime import zero1
    from hetero_llm.runtime.adamw import AdamW

    made = []  # the optimizer this rank builds (ours on CPU: plain AdamW or ZeRO-1)
    for cls in (zero1.ShardedAdamW, AdamW):

        def init(self, *args, _original=cls.__init__, **kwargs):
            _original(self, *args, **kwargs)
            made.append(self)

        cls.__init__ = init
    rss_before = status_bytes("VmRSS")
    launch.main(argv, standalone_mode=False)
    peak, rss_after = status_bytes("VmHWM"), status_bytes("VmRSS")
    if not made:
        raise RuntimeError(f"hetero-launch {' '.join(argv)} built no optimizer (did it stop early?)")
    opt = made[0]
    if isinstance(opt, zero1.ShardedAdamW):
        state = opt.state_bytes
    else:
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    lay = layout_mod.load(argv[0], [a for i, a in enumerate(argv) if i and argv[i - 1] == "--set"])
    plan, rank = compile_plan(lay), int(argv[argv.index("--rank") + 1])
    zero = lay.train.optimizer is Optimizer.ADAMW_ZERO1
    record = {
        "rank": rank,
        "state_bytes": state,
        "formula_bytes": 8 * zero1_slices.state_elements(plan, rank, zero),
        "rss_before": rss_before,
        "peak_rss": peak,
        "rss_after": rss_after,
    }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))


def run(pipelines, optimizer: str, hidden: int, layers: int, steps: int, work: Path) -> list[dict]:
    layout = work / f"{optimizer}.toml"
    L.dump(optimizer_layout(str(layout), pipelines, hidden, layers, steps, optimizer), layout)
    out = work / optimizer
    out.mkdir()
    world = sum(t for _, _, stages in pipelines for _, t in stages)
    for attempt in range(3):  # a free port can be taken by another program before rank 0 listens on it
        try:
            benchlib.start_ranks(
                "bench.memory.zero1_memory",
                ["--child", str(out), "--", str(layout), "--quiet", "--set", f"cluster.port={benchlib.free_port()}"],
                world,
            )
            break
        except RuntimeError as e:
            if "address already in use" not in str(e) or attempt == 2:
                raise
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def plot(results: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.6), dpi=120)
    FigureCanvasAgg(fig)
    for i, key in enumerate(("state_mib", "added_mib")):
        ax = fig.add_subplot(1, 2, i + 1)
        labels = [f"{r['layout'].split(',')[0]}\nrank {r['rank']}" for r in results]
        xs = range(len(results))
        ax.bar([x - 0.2 for x in xs], [r[f"adamw_{key}"] for r in results], 0.4, label="adamw")
        ax.bar([x + 0.2 for x in xs], [r[f"zero1_{key}"] for r in results], 0.4, label="adamw_zero1")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("MiB")
        ax.set_title("optimizer state" if key == "state_mib" else "peak RSS added by training", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and one step (checks the script)")
    parser.add_argument("--out-dir", type=Path, default=benchlib.RESULTS)
    args = benchlib.rank_script_args(parser, child)
    if args is None:  # this process was one rank (--child)
        return
    hidden, layers, steps = (64, 4, 1) if args.quick else (512, 4, 3)
    load_before = benchlib.load_average()
    results = []
    with tempfile.TemporaryDirectory(prefix="hl_zero1_") as tmp:
        for name, pipelines in LAYOUTS:
            benchlib.say(f"{name}: hidden {hidden}, {layers} layers, {steps} steps")
            work = Path(tmp) / name.replace(" ", "_").replace(",", "")
            work.mkdir()
            by = {opt: run(pipelines, opt, hidden, layers, steps, work) for opt in OPTIMIZERS}
            for plain, zero in zip(by["adamw"], by["adamw_zero1"]):
                mib = 2**20
                results.append(
                    {
                        "layout": name,
                        "rank": plain["rank"],
                        "adamw_state_mib": plain["state_bytes"] / mib,
                        "zero1_state_mib": zero["state_bytes"] / mib,
                        "zero1_formula_mib": zero["formula_bytes"] / mib,
                        "state_factor": plain["state_bytes"] / zero["state_bytes"],
                        "adamw_peak_mib": plain["peak_rss"] / mib,
                        "zero1_peak_mib": zero["peak_rss"] / mib,
                        "adamw_added_mib": (plain["peak_rss"] - plain["rss_before"]) / mib,
                        "zero1_added_mib": (zero["peak_rss"] - zero["rss_before"]) / mib,
                        "adamw_end_mib": plain["rss_after"] / mib,
                        "zero1_end_mib": zero["rss_after"] / mib,
                    }
                )
    load_after = benchlib.load_average()
    headers = [
        "layout",
        "rank",
        "state adamw MiB",
        "state zero1 MiB",
        "formula MiB",
        "factor",
        "peak RSS adamw MiB",
        "peak RSS zero1 MiB",
        "added adamw MiB",
        "added zero1 MiB",
        "saved MiB",
        "end RSS adamw MiB",
        "end RSS zero1 MiB",
    ]
    rows = [
        [
            r["layout"],
            r["rank"],
            benchlib.fmt(r["adamw_state_mib"]),
            benchlib.fmt(r["zero1_state_mib"]),
            benchlib.fmt(r["zero1_formula_mib"]),
            f"{r['state_factor']:.2f}",
            f"{r['adamw_peak_mib']:.0f}",
            f"{r['zero1_peak_mib']:.0f}",
            f"{r['adamw_added_mib']:.0f}",
            f"{r['zero1_added_mib']:.0f}",
            f"{r['adamw_added_mib'] - r['zero1_added_mib']:.0f}",
            f"{r['adamw_end_mib']:.0f}",
            f"{r['zero1_end_mib']:.0f}",
        ]
        for r in results
    ]
    info = benchlib.machine()
    md = "\n\n".join(
        [
            "\n".join(
                benchlib.report_head(
                    f"ZeRO-1 memory per rank (hidden {hidden}, {layers} layers, {steps} steps, gloo on CPU)",
                    info,
                    load_before,
                    load_after,
                )
            ).rstrip(),
            benchlib.markdown_table(headers, rows),
            "state: bytes of AdamW moments the rank's optimizer keeps (formula: `8 x zero1_slices.state_elements`); "
            "added: peak resident memory (VmHWM) minus the resident memory before training (after imports); "
            "end RSS: resident memory when training has returned (parameters and moments live, gradients freed).",
        ]
    )
    payload = {
        "command": benchlib.command_line(),
        "machine": info,
        "load_before": load_before,
        "load_after": load_after,
        "hidden": hidden,
        "layers": layers,
        "steps": steps,
        "results": results,
    }
    benchlib.write_results(args.out_dir, "zero1_memory", md, payload)
    plot(results, args.out_dir / "zero1_memory.png")
    print(md)


if __name__ == "__main__":
    main()
