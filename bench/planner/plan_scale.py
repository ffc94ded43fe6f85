"""hetero-plan at scale: its search time, and its plan against the best plan any method here finds.

    taskset -c 0 python -m bench.planner.plan_scale                   # 1024 and 2048 GPUs (tens of minutes)
    taskset -c 0 python -m bench.planner.plan_scale --sizes 1024 --no-alternatives   # the search time alone

The clusters are ``layouts/clusters/mixed_1024gpu.toml``'s mix at any size (``mixed``): a quarter of the
8-GPU nodes H100 on InfiniBand (400 Gbit/s), half A100 80 GB on RoCE (200 Gbit/s), a quarter RTX 4090 on
Ethernet (100 Gbit/s), 100 Gbit/s between domains; Llama-2 7B at sequence 4096, bf16, global batch = GPUs.
At 1024 GPUs it is that file's cluster. Every plan is scored by the planner's cost model (nothing runs).

For each size: the planner's plan (its default work budget, no time cap; CPU seconds of this process: run it
on one core), and the alternatives: the planner on the cluster without the Ethernet domain (its RTX 4090s), and with the
H100s alone (plans that leave those devices idle), hetero-place's plans and the Metis-style baseline
(bench/planner/plan_baselines.py). Each domain here is one kind, so leaving a domain idle is leaving a kind idle.
The target: the planner within 5% of the best of all of them.
Results: bench/results/plan_scale.{json,md} (or --out-dir).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from bench.common import benchlib
from bench.planner import plan_baselines
from bench.planner.plan_bench import LLAMA7B, cluster_toml, load
from hetero_llm.planner import place_seeds, plan_cluster
from hetero_llm.planner.search import Planner

ROOT = Path(__file__).resolve().parents[2]
MIX = [("h100-sxm", 0, 0.25), ("a100-80g", 1, 0.5), ("rtx4090", 2, 0.25)]  # kind, domain, share of the nodes
DOMAINS = [(400, 2), (200, 3), (100, 10)]  # ib, roce, eth: Gbit/s, latency us
NAMES = ["ib", "roce", "eth"]


def mixed(gpus: int, leave_out: tuple[str, ...] = ()) -> str:
    """The mixed cluster of ``gpus`` GPUs without the domains named in ``leave_out`` (each domain is one kind)."""
    nodes = []
    for kind, dom, share in MIX:
        if NAMES[dom] in leave_out:
            continue
        nodes += [(8, kind, dom)] * int(gpus // 8 * share)
    text = cluster_toml(LLAMA7B, gpus, nodes, DOMAINS, (100, 20), 0)
    for i, name in enumerate(NAMES):  # the domains' names, as in mixed_1024gpu.toml
        text = text.replace(f'"d{i}"', f'"{name}"')
    return text


def run(gpus: int, alternatives: bool) -> dict:
    cluster = load(mixed(gpus))
    t0, c0 = time.perf_counter(), time.process_time()
    res = plan_cluster(cluster)
    row: dict = {
        "gpus": gpus,
        "ours": res.score.step_time,
        "plan": f"{len(res.best.pipelines)} pipelines, {res.best.schedule} x{res.best.chunks}, {res.best.optimizer}",
        "idle": cluster.num_devices - sum(len(s.group.devices) for p in res.best.pipelines for s in p.stages),
        "search_cpu_s": time.process_time() - c0,
        "search_wall_s": time.perf_counter() - t0,
        "evaluated": res.evaluated,
        "cut_by_time": res.cut_by_time,
        "alternatives": {},
    }
    print(
        f"{gpus} GPUs: ours {row['ours']:.4f} s ({row['plan']}, {row['idle']} idle), "
        f"{row['search_cpu_s']:.1f} s CPU ({row['search_wall_s']:.1f} s wall)",
        flush=True,
    )
    if alternatives:
        alt = row["alternatives"]
        for leave in [("eth",), ("roce", "eth")]:  # the Ethernet GPUs idle; only the H100s
            sub = load(mixed(gpus, leave))
            alt[f"planner without {' and '.join(leave)}"] = plan_cluster(sub).score.step_time
            print(f"  {list(alt)[-1]}: {list(alt.values())[-1]:.4f} s", flush=True)
        pl = Planner(cluster)
        alt["hetero-place"] = min((pl.cost.score(c).step_time for c in place_seeds(cluster)), default=math.inf)
        metis = plan_baselines.metis_style(cluster, pl.cost, pl)
        alt["Metis-style"] = metis[1].step_time if metis else math.inf
        best = min([row["ours"], *alt.values()])
        row["best_any"] = best
        row["ratio_to_best"] = row["ours"] / best
        print(f"  best of all {best:.4f} s: ours / best = {row['ratio_to_best']:.4f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,2048")
    ap.add_argument("--no-alternatives", action="store_true", help="only the planner's own plan and search time")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    load0 = os.getloadavg()
    rows = [run(int(n), not args.no_alternatives) for n in args.sizes.split(",") if n]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "plan_scale" + (f"_{args.tag}" if args.tag else "")
    (out / f"{name}.json").write_text(json.dumps({"rows": rows, "command": " ".join(sys.argv)}, indent=1))
    lines = [
        *benchlib.report_head(name, benchlib.machine(), load0, os.getloadavg()),
        "| GPUs | ours s | plan | search CPU s | best of all s | ours / best |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['gpus']} | {r['ours']:.4f} | {r['plan']}, {r['idle']} idle | {r['search_cpu_s']:.1f} | "
            f"{r.get('best_any', math.nan):.4f} | {r.get('ratio_to_best', math.nan):.4f} |"
        )
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
