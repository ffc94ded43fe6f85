"""Hot switching with a context-parallel bucket against static layouts, on two emulated devices (issue 36, 5b).

    flock /work/bench.lock python -m bench.hot_switch.cp_buckets [--regime a100-ib100] [--steps 8]

The hot-switching bench's model, corpus and regime (``hot_switch_config.Config``: hidden 64, 4 layers, seq_len
512, lognormal documents of median 48, two emulated devices of 4 GFLOP/s whose TP link keeps the regime's ratio of
TP all-reduces to matmuls; A100 TP 2 across nodes over 100 Gbit/s InfiniBand by default), over loopback: **at most
2 computing ranks**. The regime where the longest rows need CP: the bench's memory cap holds ``cap_positions`` =
256 positions per device, half the longest row, so a 512-position row fits a device only split (TP 2 or cp 2;
DP 2 is run too, as what it would give without the cap). Static layouts: TP 2, cp 2, DP 2 (over the cap).
Switching: documents of up to 256 positions under DP 2 (one row fits a device), the rest under the home layout's
cp 2, whose bucket is sized by its documents and topped up with short documents; each bucket's rows one per
microbatch (elastic).

Measured: tokens/s over the real targets (median step after ``warmup``), every layout on the same documents. Not
the planner's best static layout (``hetero-plan`` with CP and buckets is the planner's side): the static layouts
that fit the cap, by hand. Results: bench/results/cp_buckets.{md,json}.

Superseded for issue 36 5b by ``python -m bench.hot_switch.hot_switch --max-cp 2`` (the planner's best static layout
with CP and what ``--buckets`` proposes or rejects; docs/benchmarks.md); this run is kept for its history.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import attrs

from bench.common import benchlib
from bench.hot_switch.hot_switch_config import Config, device_spec
from bench.hot_switch.hot_switch_regimes import REGIMES


def head(cfg: Config) -> str:
    return f"""[model]
layers = {cfg.layers}
hidden = {cfg.hidden}
heads = {cfg.heads}
vocab = {cfg.vocab}
seq_len = {cfg.seq_len}

[train]
steps = {cfg.steps}
global_batch = {cfg.global_batch}
seed = 1

[data]
packing = "documents"
doc_len_median = {cfg.median}
doc_len_sigma = {cfg.sigma}

[cluster]
[[cluster.nodes]]
name = "node0"
devices = ["cpu", "cpu"]
"""


def one_stage(batch: int, microbatches: int, devices: list[str], cp: int = 1, table: str = "pipelines") -> str:
    cp_line = f"cp = {cp}\n" if cp > 1 else ""
    devs = ", ".join(f'"{d}"' for d in devices)
    return (
        f"\n[[{table}]]\nbatch = {batch}\nmicrobatches = {microbatches}\n[[{table}.stages]]\nlayers = 4\n"
        f"devices = [{devs}]\n{cp_line}"
    )


def layouts(cfg: Config) -> dict[str, str]:
    b, both = cfg.global_batch, ["node0:0", "node0:1"]
    dp = one_stage(b // 2, b // 2, ["node0:0"]) + one_stage(b // 2, b // 2, ["node0:1"])
    short = (
        f"\n[[buckets]]\nmax_len = {cfg.short}\nelastic = true\n"
        + one_stage(1, 1, ["node0:0"], table="buckets.pipelines")
        + one_stage(1, 1, ["node0:1"], table="buckets.pipelines")
    )
    return {
        "static TP 2": head(cfg) + one_stage(b, b, both),
        "static cp 2": head(cfg) + one_stage(b, b, both, cp=2),
        "static DP 2 (over the cap)": head(cfg) + dp,
        "switching: DP 2 <= 256, home cp 2": head(cfg)
        + one_stage(b, b, both, cp=2)
        + short
        + f"\n[[buckets]]\nmax_len = {cfg.seq_len}\nelastic = true\ntop_up = true\n",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regime", default="a100-ib100", choices=sorted(REGIMES))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", type=Path, default=benchlib.RESULTS)
    args = ap.parse_args()
    cfg = attrs.evolve(Config(), regime=args.regime, steps=args.steps)
    env = {"HETERO_EMULATE_DEVICE": "*:" + device_spec(cfg), "OMP_NUM_THREADS": "1"}
    info, before = benchlib.machine(), benchlib.load_average()
    rows, payload = [], {"regime": REGIMES[args.regime].derivation(), "device": env, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="cp_buckets-") as tmp:
        for i, (name, text) in enumerate(layouts(cfg).items()):
            layout = Path(tmp) / f"l{i}.toml"
            layout.write_text(text)
            run = benchlib.launch_layout(layout, Path(tmp) / f"run{i}", env=env, timeout=1200)
            step_s = benchlib.steady([r["seconds"] for r in run.rows], cfg.warmup)
            tokens = benchlib.steady([r["tokens"] for r in run.rows], cfg.warmup)
            rate = sum(tokens) / sum(step_s)
            rows.append([name, benchlib.median(step_s), rate])
            payload["runs"][name] = {"step_s": step_s, "tokens": tokens}
            benchlib.say(f"{name}: {rate:.0f} tokens/s")
    best = max(r[2] for r in rows[:2])  # the static layouts that fit the cap
    for r in rows:
        r.append(r[2] / best)
    after = benchlib.load_average()
    table = benchlib.markdown_table(["layout", "median step s", "tokens/s", "vs best static within the cap"], rows)
    md = "\n".join([*benchlib.report_head("cp_buckets", info, before, after), payload["regime"], "", table])
    print(md)
    benchlib.write_results(args.out, "cp_buckets", md, payload)


if __name__ == "__main__":
    main()
