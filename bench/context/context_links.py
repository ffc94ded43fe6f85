"""Tokens/s of a long-row stage at cp 1, 2 and 4 over shaped links, ring overlap on and off, against
``hetero-plan --evaluate``.

    sudo python -m bench.context.context_links            # seq_len 1024, 6 steps, cp 1, 2, 4
    sudo python -m bench.context.context_links --quick    # seq_len 256, 3 steps, cp 1, 2 (seconds)

Needs root (Linux network namespaces, bench/testbed/); without it, it says why and exits 0.

Each CP rank is an emulated node of the testbed (a network namespace), one domain whose links ``tc tbf`` holds
at ``--mbit`` each way, so the ring's key/value transfers are real gloo TCP messages through a slow link. Each
rank is an emulated device (``HETERO_EMULATE_DEVICE='*:gflops=G'``): a compute action lasts its modelled
duration, each ring step's attention blocks their modelled share (``context_rows.emulated_ring``), while the
step's posted transfer travels in gloo's background, as on a GPU; what a transfer does not hide lengthens the
action. ``cp_overlap = false`` waits for each transfer before the next block.

The regime keeps a real ratio: K/V transfer time over one attention block is ``2 cp F / (S B)`` (F: attention
FLOP/s, B: link bytes/s, S: sequence), independent of the model's width. Llama-7B at 32K, CP 2 across A100 nodes
at ~150 TFLOP/s attention over 200 Gbit/s InfiniBand gives ~0.7; the defaults here (2 GFLOP/s, 1024 positions,
the link at 178 Mbit/s, ~1 MiB per transfer) give the same 0.7 forward.

The prediction is ``hetero-plan CLUSTER --evaluate LAYOUT`` of the same stage on a cluster file whose device
kind has the emulated FLOP/s and whose link is the testbed path's measured TCP goodput (``tcp_probe``): the
planner prices a stage's ring over its node's link (it places a stage on one node), which is that path here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import benchlib
from bench.context.context_speed import predicted  # hetero-plan CLUSTER --evaluate LAYOUT --json

__all__ = ["config", "main", "predicted", "run_on_testbed", "texts"]

MODEL = """[model]
layers = 2
hidden = {hidden}
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
"""

STAGE = """
[[pipelines]]
batch = {batch}
microbatches = {microbatches}
[[pipelines.stages]]
layers = 2
devices = [{devices}]
cp = {cp}
cp_overlap = {overlap}
"""

PLAN = """
[plan]
attention = "flash"
p2p_latency_us = {latency_us:.1f}
[plan.nodes]
n0 = "emu"
[plan.kinds.emu]     # the emulated device (HETERO_EMULATE_DEVICE's gflops), its link the testbed's path
tflops = {tflops}
memory_gb = 8
link_gbps = {link_gbps:.6g}
mem_bw_gbs = 1000
"""


def texts(cfg: dict, cp: int, overlap: bool, hosts: list[str]) -> tuple[str, str, str]:
    """(layout on ``cp`` nodes at ``hosts``; the same stage on one node, and that node's cluster file, for
    --evaluate)."""
    head = MODEL.format(**cfg)
    flag = "true" if overlap else "false"
    nodes = "".join(f'[[cluster.nodes]]\nname = "n{i}"\nhost = "{h}"\ndevices = ["cpu"]\n' for i, h in enumerate(hosts))
    run = f"{head}\n[cluster]\ntimeout_s = 300.0\n{nodes}" + STAGE.format(
        devices=", ".join(f'"n{i}:0"' for i in range(cp)), cp=cp, overlap=flag, **cfg
    )
    one = ", ".join(['"cpu"'] * cp)
    cluster = f'{head}\n[cluster]\ntimeout_s = 300.0\n[[cluster.nodes]]\nname = "n0"\ndevices = [{one}]\n'
    plan = cluster + STAGE.format(devices=", ".join(f'"n0:{i}"' for i in range(cp)), cp=cp, overlap=flag, **cfg)
    return run, plan, cluster + PLAN.format(tflops=cfg["gflops"] / 1e3, **cfg)


def run_on_testbed(tb, layout: Path, cp: int, workdir: Path, gflops: float, timeout_s: float = 900) -> list[dict]:
    """One ``hetero-launch`` per emulated node (each finds its rank by its address); the metrics rows."""
    metrics = workdir / "metrics.jsonl"
    env = {
        "HETERO_EMULATE_DEVICE": f"*:gflops={gflops:g}",
        "GLOO_SOCKET_IFNAME": "dom0",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "",
        "MASTER_PORT": "",
    }
    argv = [sys.executable, "-m", "hetero_llm.cli", str(layout), "--quiet", "--metrics-jsonl", str(metrics)]
    argv += ["--set", f"cluster.port={benchlib.free_port()}"]
    procs, logs = [], []
    try:
        for i in range(cp):
            logs.append(workdir / f"node{i}.log")
            with open(logs[-1], "w") as log:
                procs.append(tb.run(f"node{i}", argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=benchlib.ROOT))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode != 0 for p in procs):
        output = "\n".join(f"--- node{i}\n{path.read_text()}" for i, path in enumerate(logs))
        raise RuntimeError(f"{' '.join(argv)} failed on the testbed:\n{output}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def config(quick: bool, gflops: float, mbit: float) -> dict:
    if quick:  # T / block as the full run's: the sequence 4x shorter, the link 4x faster
        return dict(seq_len=256, hidden=64, steps=3, batch=8, microbatches=2, gflops=gflops, mbit=4 * mbit)
    return dict(seq_len=1024, hidden=64, steps=6, batch=8, microbatches=2, gflops=gflops, mbit=mbit)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="seq_len 256, 3 steps, cp 1 and 2")
    ap.add_argument("--gflops", type=float, default=2.0, help="the emulated device's GFLOP/s")
    ap.add_argument("--mbit", type=float, default=178.0, help="the shaped link's rate, Mbit/s each way")
    ap.add_argument("--cps", default="", help="the cp sizes to run, e.g. '1,4' (default: 1, 2, 4; --quick: 1, 2)")
    ap.add_argument("--out", "--out-dir", dest="out", type=Path, default=benchlib.RESULTS)
    args = ap.parse_args()
    from bench import testbed

    ok, why = testbed.available()
    if not ok:
        print(f"context_links: skipped: needs root and Linux network namespaces ({why})")
        return
    cfg = config(args.quick, args.gflops, args.mbit)
    cps = tuple(int(c) for c in args.cps.split(",")) if args.cps else (1, 2) if args.quick else (1, 2, 4)
    skip = 1 if args.quick else 2
    runs = [(cp, overlap) for cp in cps for overlap in ((True,) if cp == 1 else (True, False))]
    fabric = testbed.FabricSpec(f"{cfg['mbit']:g}mbit", "0us")
    nodes = tuple(testbed.EmulatedNode(f"node{i}", "d0") for i in range(max(cps)))
    spec = testbed.TestbedSpec((testbed.EmulatedDomain("d0", fabric),), nodes, fabric)
    info, before = benchlib.machine(), benchlib.load_average()
    payload: dict = {"config": cfg, "skip": skip, "runs": []}
    rows = []
    with (
        testbed.Testbed(spec, delay=testbed.DelayMode.NONE) as tb,
        tempfile.TemporaryDirectory(prefix="cplinks-") as tmp,
    ):
        path = testbed.measure(tb, "node0", "node1", "domain", seconds=1.0)
        cfg.update(link_gbps=path.bits_per_s / 1e9, latency_us=path.rtt_s / 2 * 1e6)
        payload["path"] = {"bits_per_s": path.bits_per_s, "rtt_s": path.rtt_s}
        benchlib.say(f"path node0 -> node1: {path.bits_per_s / 1e6:.1f} Mbit/s goodput, RTT {path.rtt_s * 1e6:.0f} us")
        for cp, overlap in runs:
            hosts = [tb.address(f"node{i}", "domain") for i in range(cp)]
            run_text, plan_text, cluster_text = texts(cfg, cp, overlap, hosts)
            name = f"cp{cp}{'' if overlap else '-off'}"
            work = Path(tmp) / name
            work.mkdir()
            (work / "layout.toml").write_text(run_text)
            (work / "cluster.toml").write_text(cluster_text)
            (work / "plan_layout.toml").write_text(plan_text)
            pred = predicted(work / "cluster.toml", work / "plan_layout.toml")
            benchlib.say(f"{name}: predicted step {pred['step_time']:.3f} s; running {cfg['steps']} steps")
            metrics = run_on_testbed(tb, work / "layout.toml", cp, work, cfg["gflops"])
            step_s = [r["seconds"] for r in metrics]
            measured = benchlib.median(benchlib.steady(step_s, skip))
            tokens = cfg["batch"] * cfg["seq_len"]
            rows.append([cp, "on" if overlap else "off", pred["step_time"], measured, measured / pred["step_time"]])
            rows[-1] += [tokens / measured]
            payload["runs"].append({"cp": cp, "overlap": overlap, "predicted": pred, "step_s": step_s})
    after = benchlib.load_average()
    base = rows[0][5]
    for row in rows:
        row.append(row[5] / base)
    headers = ["cp", "overlap", "predicted step s", "measured step s", "measured / predicted", "tokens/s", "vs cp 1"]
    table = benchlib.markdown_table(headers, rows)
    link = f"link: {cfg['mbit']:g} Mbit/s tbf each way, measured {cfg['link_gbps'] * 1e3:.1f} Mbit/s TCP goodput"
    head = benchlib.report_head("context_links", info, before, after)
    md = "\n".join([*head, link, "", table])
    print(md)
    name = (
        "context_links" + ("_quick" if args.quick else "") + (f"_gflops{args.gflops:g}" if args.gflops != 2.0 else "")
    )
    benchlib.write_results(args.out, name, md, payload)


if __name__ == "__main__":
    main()
