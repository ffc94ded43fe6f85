"""Tokens/s of one long-row layout at cp 1 and cp 2 on emulated devices, against ``hetero-plan --evaluate``.

    python -m bench.context.context_speed            # seq_len 1024, 8 steps
    python -m bench.context.context_speed --quick    # seq_len 256, 5 steps

A tiny model (2 layers, hidden 32, 2 heads, vocab 64, RoPE, SwiGLU) trains rows of ``seq_len`` positions on one
stage of cp 1 (one rank) and cp 2 (two ranks: **the machine has 2 cores, so two computing ranks at most**).
Every rank is an emulated device (``HETERO_EMULATE_DEVICE='*:gflops=G'``, runtime/emulation.py): each compute
action lasts its modelled duration (``predict.device.action_seconds``; a CP rank's share of the rows' attention,
``context_rows.attention_square``), the real computation running inside it. The prediction is ``hetero-plan
CLUSTER --evaluate LAYOUT`` on a cluster file whose device kind has the emulated FLOP/s (``plan.attention =
"flash"``, which CP pricing requires).

Measured: wall step times (median after warm-up) of real ``hetero-launch`` runs, whose ring transfers are real gloo
messages on this host. Not measured: shaped links (the cluster file's link is not imposed on the ring's
messages: host-local gloo), and the ring's overlap on and off: both in bench/context/context_links.py (testbed links, ``cp_overlap``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import benchlib

MODEL = """[model]
layers = 2
hidden = 32
heads = 2
vocab = 64
seq_len = {seq_len}
mlp = "swiglu"
norm = "rmsnorm"
position = "rope"

[train]
steps = {steps}
global_batch = {batch}
seed = 7
schedule = "1f1b"
lr = 1e-3
min_lr = 1e-4
warmup_steps = 1
weight_decay = 0.1
log_every = 1

[data]
kind = "grammar"

[cluster]
timeout_s = 300.0
[[cluster.nodes]]
name = "n0"
devices = [{devices}]
"""

PIPELINE = """
[[pipelines]]
batch = {batch}
microbatches = {microbatches}
[[pipelines.stages]]
layers = 2
devices = [{devices}]
cp = {cp}
"""

PLAN = """
[plan]
attention = "flash"
[plan.nodes]
n0 = "emu"
[plan.kinds.emu]     # the emulated device: HETERO_EMULATE_DEVICE's gflops
tflops = {tflops}
memory_gb = 8
link_gbps = 40
mem_bw_gbs = 1000
"""


def texts(cp: int, seq_len: int, steps: int, batch: int, microbatches: int, gflops: float) -> tuple[str, str]:
    """(layout, cluster file) of one stage with ``cp`` ranks."""
    devices = ", ".join(['"cpu"'] * cp)
    head = MODEL.format(seq_len=seq_len, steps=steps, batch=batch, devices=devices)
    names = ", ".join(f'"n0:{i}"' for i in range(cp))
    layout = head + PIPELINE.format(batch=batch, microbatches=microbatches, devices=names, cp=cp)
    return layout, head + PLAN.format(tflops=gflops / 1e3)


def predicted(cluster: Path, layout: Path) -> dict:
    cmd = [sys.executable, "-m", "hetero_llm.cli.plan", str(cluster), "--evaluate", str(layout), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=benchlib.ROOT)
    return json.loads(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="seq_len 256, 5 steps")
    ap.add_argument("--gflops", type=float, default=1.0, help="the emulated device's GFLOP/s")
    ap.add_argument("--out", type=Path, default=benchlib.RESULTS)
    args = ap.parse_args()
    seq_len, steps, skip = (256, 5, 2) if args.quick else (1024, 8, 2)
    batch, microbatches = 4, 2
    info, before = benchlib.machine(), benchlib.load_average()
    rows, payload = [], {"seq_len": seq_len, "steps": steps, "skip": skip, "gflops": args.gflops, "runs": []}
    with tempfile.TemporaryDirectory(prefix="context_speed-") as tmp:
        for cp in (1, 2):
            layout_text, cluster_text = texts(cp, seq_len, steps, batch, microbatches, args.gflops)
            layout, cluster = Path(tmp) / f"cp{cp}.toml", Path(tmp) / f"cluster{cp}.toml"
            layout.write_text(layout_text)
            cluster.write_text(cluster_text)
            pred = predicted(cluster, layout)
            benchlib.say(f"cp {cp}: predicted step {pred['step_time']:.3f} s; running {steps} steps")
            env = {"HETERO_EMULATE_DEVICE": f"*:gflops={args.gflops:g}", "OMP_NUM_THREADS": "1"}  # a core a rank
            run = benchlib.launch_layout(layout, Path(tmp) / f"run{cp}", env=env, timeout=1200)
            step_s = [r["seconds"] for r in run.rows]
            measured = benchlib.median(benchlib.steady(step_s, skip))
            tokens = batch * seq_len
            rows.append([cp, cp, pred["step_time"], measured, measured / pred["step_time"], tokens / measured])
            payload["runs"].append({"cp": cp, "predicted": pred, "step_s": step_s, "cpu_s": run.cpu_s})
    after = benchlib.load_average()
    base = rows[0][5]
    for row in rows:
        row.append(row[5] / base)
    headers = ["cp", "ranks", "predicted step s", "measured step s", "measured / predicted", "tokens/s", "vs cp 1"]
    table = benchlib.markdown_table(headers, rows)
    head = benchlib.report_head("context_speed", info, before, after)
    md = "\n".join([*head, table])
    print(md)
    benchlib.write_results(args.out, "context_speed" + ("_quick" if args.quick else ""), md, payload)


if __name__ == "__main__":
    main()
