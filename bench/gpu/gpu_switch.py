"""The GPU benchmark's switch measurement (``python -m bench.gpu.gpu_bench``, ``--switch``): hot switching on CUDA.

One [[buckets]] layout of the benchmark's first case's model (bf16 compute, float32 master weights): home TP 2 (one
stage over two ranks), documents of up to a quarter of ``seq_len`` under DP 2 (elastic: as many rows as a step's
short documents fill), the rest under the home layout; grammar documents of median length ``seq_len / 4``. On one GPU
both ranks share it over gloo (the exchange staged through host memory); on two or more, cuda:0 and cuda:1 over NCCL
(one ``batch_isend_irecv`` per switch in the switch group). Run once with ``--trace`` (which synchronizes the device
after every action, so a switch's time includes its copies); per steady step, the seconds rank 0 spends in switches
(waiting for the other rank included) and the switches' own time (last rank in to last rank out,
``bench.hot_switch.hot_switch_runs.switch_times``); the bytes a step's two switches move over the network (the
switch planner's: parameters home -> bucket 0, gradients bucket 0 -> home), and that over the switches' own time.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from bench.common import benchlib
from bench.gpu.gpu_bench_cases import Case
from bench.hot_switch.hot_switch_runs import switch_times


def buckets_toml(case: Case, devices: list[str], backend: str, steps: int) -> str:
    """The switch layout (module doc): ``devices`` the two ranks' (one node each when they repeat a GPU)."""
    s, seq = case.size, case.seq
    nodes = (
        [("node0", devices)] if len(set(devices)) == len(devices) else [(f"g{i}", [d]) for i, d in enumerate(devices)]
    )
    ids = [f"{n}:{i}" for n, ds in nodes for i in range(len(ds))]
    text = [
        f"[model]\nlayers = {s.layers}\nhidden = {s.hidden}\nheads = {s.heads}\nvocab = {s.vocab}\nseq_len = {seq}\n",
        f'[train]\nsteps = {steps}\nglobal_batch = {case.batch}\nseed = 0\nprecision = "bf16"\nlog_every = 1\n',
        f'[data]\npacking = "documents"\ndoc_len_median = {seq / 4}\n',
        f'[cluster]\nbackend = "{backend}"\ntimeout_s = 300.0\n',
    ]
    text += [f'[[cluster.nodes]]\nname = "{n}"\ndevices = {ds!r}\n'.replace("'", '"') for n, ds in nodes]
    both = ", ".join(f'"{d}"' for d in ids)
    text.append(
        f"[[pipelines]]\nbatch = {case.batch}\nmicrobatches = 1\n[[pipelines.stages]]\nlayers = {s.layers}\n"
        f"devices = [{both}]\n"
    )
    text.append(f"[[buckets]]\nmax_len = {seq // 4}\nelastic = true\n")
    text += [
        f"[[buckets.pipelines]]\nbatch = 1\nmicrobatches = 1\n[[buckets.pipelines.stages]]\nlayers = {s.layers}\n"
        f'devices = ["{d}"]\n'
        for d in ids
    ]
    text.append(f"[[buckets]]\nmax_len = {seq}\n")
    return "\n".join(text)


def network_bytes(path: Path) -> int:
    """What a step that runs bucket 0 moves over the network: its parameters in, its gradients back home."""
    from hetero_llm import layout as layout_mod
    from hetero_llm.plan import compile_plan
    from hetero_llm.switching.transfers import step_switch

    home = compile_plan(layout_mod.load(path))
    bucket = home.buckets[0]
    into = step_switch(home, home, bucket, params=True, grads=False)
    back = step_switch(home, bucket, home, params=False, grads=True)
    return sum(t.nbytes for plan in (into, back) for t in plan.transfers if not t.local)


def measure(case: Case, device: torch.device, steps: int, warmup: int, workdir: Path) -> dict:
    """The switch layout on ``device`` (and the next GPU, over NCCL, where there is one), traced (module doc)."""
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        devices, backend = ["cuda:0", "cuda:1"], "nccl"
    else:
        name = "cpu" if device.type == "cpu" else f"cuda:{device.index}"
        devices, backend = [name, name], "gloo"
    path = workdir / "switch.toml"
    path.write_text(buckets_toml(case, devices, backend, steps))
    trace = workdir / "switch_trace"
    rows = benchlib.run_layout(path, workdir / "switch_run", trace=trace, timeout=1800)
    rank0, own = switch_times(trace)
    nbytes = network_bytes(path)
    own_s = statistics.median(benchlib.steady(own, warmup)) if len(own) > warmup else float("nan")
    return {
        "layout": f"home TP 2, documents of 1-{case.seq // 4} positions under DP 2 (elastic)",
        "devices": " ".join(devices),
        "backend": backend,
        "model": case.size.name,
        "seq": case.seq,
        "batch": case.batch,
        "steps_with_switches": len(own),
        "switch_s_rank0": statistics.median(benchlib.steady(rank0, warmup)) if len(rank0) > warmup else float("nan"),
        "switch_s": own_s,
        "network_mib": nbytes / 2**20,
        "gb_per_s": nbytes / own_s / 1e9 if own_s > 0 else float("nan"),
        "step_s": benchlib.median(benchlib.steady([r["seconds"] for r in rows], warmup)),
    }


def report(row: dict) -> list[str]:
    """The switch section of the GPU benchmark's report."""
    return [
        "## Hot switching: a step's switches (traced)",
        "",
        f"{row['layout']}, {row['model']} at seq {row['seq']}, batch {row['batch']}, on {row['devices']} over "
        f"{row['backend']}; per steady step (medians; {row['steps_with_switches']} steps switched):",
        "",
        benchlib.markdown_table(
            ["switches ms (rank 0)", "switches ms (own)", "network MiB", "GB/s", "step ms"],
            [
                [
                    row["switch_s_rank0"] * 1e3,
                    row["switch_s"] * 1e3,
                    row["network_mib"],
                    row["gb_per_s"],
                    row["step_s"] * 1e3,
                ]
            ],
        ),
        "",
    ]
