"""The control plane at scale: CPU seconds of each step before training, from 8 to 4,096 ranks.

    python -m bench.launch.control_plane                      # 8 .. 4096 ranks (a few minutes)
    python -m bench.launch.control_plane --quick              # 8 and 64 ranks, every phase in this process (seconds)

Each size is a layout shaped like ``layouts/planned/mixed_1024gpu.toml`` (what hetero-plan gives its mixed
cluster): Llama-2 7B, interleaved x2, ZeRO-1, NCCL, three network domains, pipelines of 4 stages and 8 GPUs,
every other one cut differently (TP 2/2/2/2 with layers 18/6/6/2, TP 4/2/1/1 with 16/8/4/4), so gradient
sync cuts finest common blocks between pipelines and ZeRO-1 splits them. Each stage position has its own
nodes (8 GPUs each, stage k in domain k mod 3) whose hosts are IP addresses of no machine here: host checks
run and find no local node, as a dry run on a laptop does, without waiting on DNS.

The phases, each in a fresh process (nothing cached from another phase), timed with ``time.process_time``
(every thread's CPU, the host-resolving threads' too):

- load: reading and checking the TOML (``layout.load``);
- compile: ``compile_plan`` (every rank's ``RankPlan``, groups, sync blocks, ZeRO-1 units and slices);
- preflight: ``preflight.prepare`` of a dry run (load, compile, environment, rendezvous, hosts, memory, paths);
- rank setup: what one rank does from its ``RankPlan`` before it creates communicators, the slowest of
  ranks 0, N/2 and N-1: its groups (``member_groups``), the environment of every group it creates, its ZeRO-1
  units' sizes (``elements``, ``chunk``) and its ``--dry-run --rank R`` report;
- dry-run: ``hetero-launch L.toml --dry-run`` in-process (preflight included), and ``--dry-run --full``.

The target (issue 33): each phase within 10 s at 4,096 ranks and near-linear in ranks (the last column:
CPU at the largest size over CPU at 1/8 of it, 8 for linear). Results: bench/results/control_plane.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import benchlib as B
from hetero_llm import layout as L

SIZES = (8, 64, 512, 1024, 2048, 4096)
QUICK = (8, 64)
PHASES = ("load", "compile", "preflight", "rank setup", "dry-run", "dry-run --full")
TARGET_S = 10.0
# (TP size, layers) per stage of the two pipeline shapes, alternating: 8 GPUs each
SHAPES = (((2, 18), (2, 6), (2, 6), (2, 2)), ((4, 16), (2, 8), (1, 4), (1, 4)))
DOMAINS = (("ib", L.DomainKind.IB, 400.0, 2.0), ("roce", L.DomainKind.ROCE, 200.0, 3.0))
DOMAINS += (("eth", L.DomainKind.ETHERNET, 100.0, 10.0),)
GPUS_PER_NODE = 8


def scale_layout(file: str, ranks: int) -> L.Layout:
    """``ranks`` GPUs (a multiple of 8) in pipelines of SHAPES, alternating; module doc."""
    model = L.ModelSpec(
        layers=32,
        hidden=4096,
        heads=32,
        vocab=32000,
        seq_len=4096,
        ffn=11008,
        norm=L.Norm.RMSNORM,
        position=L.Position.ROPE,
        mlp=L.Mlp.SWIGLU,
    )
    n_pipes = ranks // GPUS_PER_NODE
    train = L.TrainSpec(
        steps=10,
        global_batch=8 * n_pipes,
        schedule=L.Schedule.INTERLEAVED,
        chunks=2,
        optimizer=L.Optimizer.ADAMW_ZERO1,
        precision=L.Precision.BF16,
    )
    used = [0, 0, 0, 0]  # devices taken so far at each stage position
    pipelines = []
    for p in range(n_pipes):
        stages = []
        for k, (tp, layers) in enumerate(SHAPES[p % 2]):
            devices = []
            for _ in range(tp):
                devices.append(f"s{k}n{used[k] // GPUS_PER_NODE}:{used[k] % GPUS_PER_NODE}")
                used[k] += 1
            stages.append(L.StageSpec(layers=layers, devices=tuple(devices)))
        pipelines.append(L.PipelineSpec(batch=8, microbatches=8, stages=tuple(stages)))
    nodes, host = [], 0
    for k, n in enumerate(used):
        for i in range(-(-n // GPUS_PER_NODE)):
            gpus = min(GPUS_PER_NODE, n - i * GPUS_PER_NODE)
            host += 1  # 10.77.x.y: an address of no machine here (module doc)
            nodes.append(
                L.NodeSpec(
                    name=f"s{k}n{i}",
                    host=f"10.77.{host // 256}.{host % 256}",
                    devices=tuple(f"cuda:{d}" for d in range(gpus)),
                    domain=DOMAINS[k % 3][0],
                )
            )
    cluster = L.ClusterSpec(
        nodes=tuple(nodes),
        backend=L.Backend.NCCL,
        domains=tuple(L.DomainSpec(name=n, kind=kind, bandwidth_gbps=bw, latency_us=us) for n, kind, bw, us in DOMAINS),
        cross_domain=L.CrossDomainSpec(bandwidth_gbps=100.0, latency_us=20.0),
    )
    return L.Layout(file=file, model=model, train=train, data=L.DataSpec(), cluster=cluster, pipelines=tuple(pipelines))


def _rank_setup(plan, rank: int) -> None:
    """What ``rank`` derives from its RankPlan before it creates communicators (module doc)."""
    from hetero_llm.plan import describe

    rp = plan.rank_plan(rank)
    rp.member_groups  # noqa: B018 (the work is the property)
    for g in (rp.world,) + rp.groups:
        rp.network.env(g.key)
    if rp.optimizer_slices is not None:
        for unit, _ in rp.optimizer_slices.units:
            unit.elements(rank)
            unit.chunk  # noqa: B018
    describe.describe_rank(rp)


def measure(phase: str, file: str) -> dict:
    """CPU seconds of ``phase`` on the layout at ``file``, in this (fresh) process."""
    from hetero_llm.plan import compile_plan

    lines = 0
    if phase in ("rank setup",):
        plan = compile_plan(L.load(file))
        n = plan.world_size
        cpu = 0.0
        for rank in sorted({0, n // 2, n - 1}):
            c0 = time.process_time()
            _rank_setup(plan, rank)
            cpu = max(cpu, time.process_time() - c0)
        return {"cpu_s": cpu}
    from click.testing import CliRunner

    from hetero_llm.cli.launch import main
    from hetero_llm.launch import preflight

    if phase == "compile":
        lay = L.load(file)
    c0 = time.process_time()  # modules imported above: only the phase's own work is counted
    if phase == "load":
        L.load(file)
    elif phase == "compile":
        compile_plan(lay)
    elif phase == "preflight":
        preflight.prepare(preflight.Request(file, dry_run=True), warn=lambda line: None)
    else:
        result = CliRunner().invoke(main, [file, "--dry-run"] + (["--full"] if phase.endswith("--full") else []))
        assert result.exit_code == 0, result.output
        lines = len(result.output.splitlines())
    return {"cpu_s": time.process_time() - c0, "lines": lines}


def _child(phase: str, file: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.launch.control_plane", "--phase", phase, "--layout", file],
        capture_output=True,
        text=True,
        check=True,
        cwd=B.ROOT,
        env=B.clean_env(),
    )
    return json.loads(proc.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="ranks, multiples of 8")
    ap.add_argument("--quick", action="store_true", help=f"sizes {QUICK} only")
    ap.add_argument("--out-dir", type=Path, default=B.ROOT / "bench" / "results")
    ap.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # one measurement, in a child process
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(measure(args.phase, args.layout)))
        return
    sizes = QUICK if args.quick else tuple(int(n) for n in args.sizes.split(",") if n)
    before = B.load_average()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_control_plane_") as tmp:
        for ranks in sizes:
            file = str(Path(tmp, f"scale_{ranks}.toml"))
            lay = scale_layout(file, ranks)
            L.dump(lay, file)
            row: dict = {"ranks": ranks, "nodes": len(lay.cluster.nodes), "pipelines": len(lay.pipelines)}
            for phase in PHASES:
                got = measure(phase, file) if args.quick else _child(phase, file)  # --quick: a smoke test, in here
                row[phase] = got["cpu_s"]
                if "lines" in got and got["lines"]:
                    row[f"{phase} lines"] = got["lines"]
            B.say(f"{ranks} ranks: " + ", ".join(f"{p} {row[p]:.2f} s" for p in PHASES))
            rows.append(row)
    after = B.load_average()
    headers = ["ranks", "nodes", *(f"{p} CPU s" for p in PHASES), "dry-run lines", "--full lines"]
    table = [
        [r["ranks"], r["nodes"], *(f"{r[p]:.2f}" for p in PHASES), r["dry-run lines"], r["dry-run --full lines"]]
        for r in rows
    ]
    growth = ""
    small = [r for r in rows if r["ranks"] * 8 == rows[-1]["ranks"]]
    if small:
        ratios = ", ".join(f"{p} {rows[-1][p] / max(small[0][p], 1e-9):.1f}x" for p in PHASES)
        growth = f"from {small[0]['ranks']} to {rows[-1]['ranks']} ranks (8x): {ratios}"
    slowest = max((rows[-1][p], p) for p in PHASES)
    verdict = (
        f"at {rows[-1]['ranks']} ranks the slowest phase is {slowest[1]}: {slowest[0]:.2f} s CPU "
        f"({'within' if slowest[0] <= TARGET_S else 'over'} the {TARGET_S:g} s target)"
    )
    md = "\n".join(
        [
            *B.report_head("control_plane", B.machine(), before, after),
            B.markdown_table(headers, table),
            "",
            verdict,
            *([growth] if growth else []),
        ]
    )
    print(md)
    B.write_results(args.out_dir, "control_plane", md, {"rows": rows, "command": B.command_line(), "sizes": sizes})


if __name__ == "__main__":
    main()
