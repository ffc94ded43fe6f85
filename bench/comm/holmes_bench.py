"""NIC domains on the emulated testbed: run layouts whose nodes sit in network domains, and the benchmark
of issue 5 (NIC-aware layout vs. a naive one vs. an all-fast network). Needs root (network namespaces).

The runner (``run_layout``) starts ``hetero-launch LAYOUT --node NAME`` inside each node's namespace,
with MASTER_ADDR = the master node's cross-domain address and GLOO_SOCKET_IFNAME = xdom for the
default group; the library then binds each group to its transport's interface (dom0 inside a domain,
xdom across). It reads tokens/s from rank 0's ``--metrics-jsonl`` and the bytes every node sent on
each interface, and the testbed is always torn down (``with Testbed(...)``).

The testbed is built from the layout itself (``testbed_spec``): one emulated domain per
``[[cluster.domains]]`` with its ``bandwidth_gbps`` and ``latency_us``, the cross-domain fabric from
``[cluster.cross_domain]``, one namespace per node. A node's ``speed`` below or above 1 becomes the
runtime's compute emulation for its ranks (HETERO_EMULATE_SLOWDOWN = fastest speed / its speed: each
compute action is stretched by sleeping), since two cores cannot be cut into slower CPUs.

    sudo python -m bench.comm.holmes_bench                      # the benchmark: 3 layouts, interleaved reps
    sudo python -m bench.comm.holmes_bench --run LAYOUT.toml    # one layout on its testbed, print tokens/s
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import click

from bench import testbed as T
from bench.common import benchlib as B
from hetero_llm import layout as layout_mod
from hetero_llm.layout import (
    ClusterSpec,
    CrossDomainSpec,
    DataSpec,
    DomainKind,
    DomainSpec,
    Layout,
    ModelSpec,
    NodeSpec,
    PipelineSpec,
    Schedule,
    StageSpec,
    TrainSpec,
)
from hetero_llm.planner.place import PlaceOptions, place_file

INTERFACES = ("dom0", "xdom")


# --------------------------------------------------------------------------------------------
# The runner


def _rate(gbps: float) -> str:
    return f"{gbps * 1000:g}mbit"


def _delay(us: float) -> str:
    return f"{us:g}us"


def testbed_spec(lay: Layout, *, cross_like_domains: bool = False) -> T.TestbedSpec:
    """An emulated cluster with the layout's domains, nodes and cross-domain network.

    ``cross_like_domains``: give the cross-domain fabric the first domain's bandwidth and latency
    (the 'every link is fast' control).
    """
    c = lay.cluster
    if not c.domains:
        raise T.TestbedError(f"{lay.file}: the layout declares no [[cluster.domains]] to emulate")
    domains = [T.EmulatedDomain(d.name, T.FabricSpec(_rate(d.bandwidth_gbps), _delay(d.latency_us))) for d in c.domains]
    x = c.cross_domain
    if cross_like_domains:
        cross = domains[0].fabric
    elif x.bandwidth_gbps <= 0:
        raise T.TestbedError(f"{lay.file}: cluster.cross_domain.bandwidth_gbps is not given (the testbed needs a rate)")
    else:
        cross = T.FabricSpec(_rate(x.bandwidth_gbps), _delay(x.latency_us))
    nodes = [T.EmulatedNode(n.name, n.domain, n.speed) for n in c.nodes]
    return T.TestbedSpec(tuple(domains), tuple(nodes), cross)


@attrs.frozen
class RunResult:
    tokens_per_s: float  # over the steps after the warm-up
    step_s: tuple[float, ...]  # every step's seconds (rank 0)
    sent_mb: dict  # interface -> MB sent per measured step, summed over nodes
    stderr: str


def sent_bytes(tb: T.Testbed, node: str) -> dict[str, int]:
    out = subprocess.run(
        ["ip", "-n", tb.namespace(node), "-s", "-j", "link", "show"], capture_output=True, text=True, check=True
    ).stdout
    return {link["ifname"]: link["stats64"]["tx"]["bytes"] for link in json.loads(out) if link["ifname"] in INTERFACES}


def run_layout(
    tb: T.Testbed,
    layout_path: str | Path,
    workdir: Path,
    *,
    steps: int,
    warmup: int,
    port: int = 29600,
    timeout_s: float = 600,
    env: dict[str, str] | None = None,
    trace: Path | None = None,
) -> RunResult:
    """Train ``layout_path`` for ``steps`` steps, one ``hetero-launch --node`` per emulated node (``env``: more
    variables for every node, e.g. the runtime's emulation; ``trace``: every rank's ``--trace`` folder)."""
    lay = layout_mod.load(layout_path)
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    master = lay.cluster.master_node.name
    env = {
        **(env or {}),
        "MASTER_ADDR": tb.address(master, "xdom"),
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "xdom",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    nodes = [n.name for n in lay.cluster.nodes]
    before = {n: sent_bytes(tb, n) for n in nodes}
    procs, logs = {}, {}
    try:
        for n in nodes:
            logs[n] = open(workdir / f"{n}.log", "w")
            argv = B.launch_command(layout_path, node=n, metrics=metrics, trace=trace, sets=[f"train.steps={steps}"])
            fastest, speed = max(m.speed for m in lay.cluster.nodes), lay.cluster.node(n).speed
            slow = {"HETERO_EMULATE_SLOWDOWN": f"*:{fastest / speed:g}"} if speed != fastest else {}
            procs[n] = tb.run(n, argv, env={**env, **slow}, stdout=logs[n], stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs.values()):
            failed = [n for n, p in procs.items() if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs.values():
            if p.poll() is None:
                T.netns._killpg(p, 15)
                p.wait()
        for f in logs.values():
            f.close()
    output = "\n".join(f"--- {n}\n" + (workdir / f"{n}.log").read_text() for n in nodes)
    bad = {n: p.returncode for n, p in procs.items() if p.returncode != 0}
    if bad:
        raise RuntimeError(f"{layout_path}: node(s) {bad} failed:\n{output}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    after = {n: sent_bytes(tb, n) for n in nodes}
    measured = rows[warmup:]
    sent = {i: sum(after[n][i] - before[n][i] for n in nodes) / 1e6 / steps for i in INTERFACES}
    return RunResult(
        sum(r["tokens"] for r in measured) / sum(r["seconds"] for r in measured),
        tuple(r["seconds"] for r in rows),
        sent,
        output,
    )


# --------------------------------------------------------------------------------------------
# The benchmark: (a) NIC-aware, (b) naive (DP across domains), (c) (a) with every link fast


def cluster_file(
    *,
    hidden: int,
    layers: int,
    heads: int,
    seq_len: int,
    batch: int,
    steps: int,
    domain_gbps: float,
    domain_us: float,
    cross_gbps: float,
    cross_us: float,
) -> str:
    """The benchmark's cluster file (the input of hetero-place): two domains of two nodes each."""
    model = ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=256, seq_len=seq_len)
    train = TrainSpec(steps=steps, global_batch=batch, seed=1, schedule=Schedule.ONE_F_ONE_B, log_every=1)
    domains = tuple(
        DomainSpec(
            name=name,
            kind=DomainKind(name),
            bandwidth_gbps=float(domain_gbps),
            latency_us=float(domain_us),
            gloo_ifname="dom0",
        )
        for name in ("ib", "roce")
    )
    cross = CrossDomainSpec(bandwidth_gbps=float(cross_gbps), latency_us=float(cross_us), gloo_ifname="xdom")
    nodes = tuple(NodeSpec(name=f"node{i}", domain="ib" if i < 2 else "roce") for i in range(4))
    cluster = ClusterSpec(nodes=nodes, timeout_s=120.0, domains=domains, cross_domain=cross)
    return layout_mod.dumps_cluster(
        {"model": model, "train": train, "data": DataSpec(), "cluster": cluster},
        header="Benchmark cluster: two domains of two emulated nodes (one CPU device each), fast inside, slow across.",
    )


def naive_pipelines(layers: int, batch: int, microbatches: int) -> tuple[PipelineSpec, ...]:
    """One pipeline per domain: stage boundaries inside a domain, every DP group across."""
    out = []
    for first, second in (("node0", "node1"), ("node2", "node3")):
        stages = tuple(
            StageSpec(layers=n, devices=(f"{node}:0",))
            for node, n in ((first, layers // 2), (second, layers - layers // 2))
        )
        out.append(PipelineSpec(batch=batch // 2, microbatches=microbatches, stages=stages))
    return tuple(out)


def naive_layout(cluster: Path, out: Path, microbatches: int) -> Path:
    """The layout of the cluster file ``cluster`` with ``naive_pipelines``, written to ``out`` (in the same
    folder: paths are written as the cluster file has them)."""
    _, _, sections = layout_mod.read_cluster_file(cluster, "the naive layout")
    pipelines = naive_pipelines(sections["model"].layers, sections["train"].global_batch, microbatches)
    layout_mod.dump(Layout(file=str(out), pipelines=pipelines, **sections), out)
    return out


def median(xs) -> float:
    return statistics.median(xs)


@click.command()
@click.option(
    "--run",
    "run_one",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="Just run this layout on a testbed built from it and print its tokens/s.",
)
@click.option("--reps", default=3, show_default=True, help="Repetitions of each layout, interleaved a, b, c, a, ...")
@click.option("--steps", default=8, show_default=True)
@click.option("--warmup", default=3, show_default=True, help="Steps left out of tokens/s.")
@click.option("--hidden", default=512, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--heads", default=8, show_default=True)
@click.option("--seq-len", default=32, show_default=True)
@click.option("--batch", default=4, show_default=True, help="Global batch (sequences per step).")
@click.option("--domain-gbps", default=1.0, show_default=True)
@click.option("--domain-us", default=100.0, show_default=True)
@click.option("--cross-gbps", default=0.1, show_default=True)
@click.option("--cross-us", default=1000.0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Keep layouts, logs and results.json here.")
def main(
    run_one,
    reps,
    steps,
    warmup,
    hidden,
    layers,
    heads,
    seq_len,
    batch,
    domain_gbps,
    domain_us,
    cross_gbps,
    cross_us,
    out,
):
    """Holmes on the testbed: (a) NIC-aware layout, (b) naive layout, (c) (a) with every link fast."""
    ok, why = T.available()
    if not ok:
        sys.exit(f"holmes_bench: needs root and network namespaces ({why})")
    work = Path(out) if out else Path(tempfile.mkdtemp(prefix="holmes_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    if run_one:
        lay = layout_mod.load(run_one)
        with T.Testbed(testbed_spec(lay)) as tb:
            r = run_layout(tb, run_one, work / "run", steps=steps, warmup=warmup)
        print(
            f"{run_one}: {r.tokens_per_s:.1f} tokens/s; MB sent per step: "
            + ", ".join(f"{k} {v:.2f}" for k, v in r.sent_mb.items())
        )
        return

    src = work / "cluster.toml"
    src.write_text(
        cluster_file(
            hidden=hidden,
            layers=layers,
            heads=heads,
            seq_len=seq_len,
            batch=batch,
            steps=steps,
            domain_gbps=domain_gbps,
            domain_us=domain_us,
            cross_gbps=cross_gbps,
            cross_us=cross_us,
        )
    )
    aware = work / "a_nic_aware.toml"
    placement = place_file(src, aware, PlaceOptions())
    mbs = placement.pipelines[0].microbatches
    naive = naive_layout(src, work / "b_naive.toml", mbs)
    lay = layout_mod.load(aware)
    configs = {
        "a": ("NIC-aware (DP in domains)", aware, False),
        "b": ("naive (DP across domains)", naive, False),
        "c": ("NIC-aware, every link fast", aware, True),
    }
    results: dict[str, list[RunResult]] = {k: [] for k in configs}
    load_before = os.getloadavg()
    print(f"work dir {work}; load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", flush=True)
    with contextlib.ExitStack() as stack:
        slow = stack.enter_context(T.Testbed(testbed_spec(lay)))
        fast = stack.enter_context(T.Testbed(testbed_spec(lay, cross_like_domains=True)))
        for rep in range(reps):
            for key, (name, path, all_fast) in configs.items():
                r = run_layout(
                    fast if all_fast else slow,
                    path,
                    work / f"{key}{rep}",
                    steps=steps,
                    warmup=warmup,
                    port=29600 + rep * 10 + ord(key) - ord("a"),
                )
                results[key].append(r)
                print(
                    f"rep {rep} {key} {name:<28} {r.tokens_per_s:8.1f} tokens/s  step {median(r.step_s[warmup:]):.3f} s  "
                    f"MB/step dom0 {r.sent_mb['dom0']:7.2f}  xdom {r.sent_mb['xdom']:7.2f}",
                    flush=True,
                )
    load_after = os.getloadavg()
    med = {k: median(r.tokens_per_s for r in rs) for k, rs in results.items()}
    table = [
        "| layout | tokens/s (median) | each repetition | MB sent per step on dom0 / xdom |",
        "| --- | ---: | --- | --- |",
    ]
    for key, (name, _, _) in configs.items():
        reps_txt = ", ".join(f"{r.tokens_per_s:.0f}" for r in results[key])
        mb = results[key][-1].sent_mb
        table.append(f"| ({key}) {name} | {med[key]:.0f} | {reps_txt} | {mb['dom0']:.1f} / {mb['xdom']:.1f} |")
    summary = (
        f"a/b = {med['a'] / med['b']:.2f}, a/c = {med['a'] / med['c']:.2f}; load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print("\n" + "\n".join(table) + "\n\n" + summary)
    (work / "results.json").write_text(
        json.dumps(
            {
                "medians_tokens_per_s": med,
                "ratios": {"a/b": med["a"] / med["b"], "a/c": med["a"] / med["c"]},
                "runs": {
                    k: [attrs.asdict(r, filter=lambda a, v: a.name != "stderr") for r in rs]
                    for k, rs in results.items()
                },
                "load": [load_before, load_after],
                "settings": dict(
                    reps=reps,
                    steps=steps,
                    warmup=warmup,
                    hidden=hidden,
                    layers=layers,
                    heads=heads,
                    seq_len=seq_len,
                    batch=batch,
                    domain_gbps=domain_gbps,
                    domain_us=domain_us,
                    cross_gbps=cross_gbps,
                    cross_us=cross_us,
                ),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
