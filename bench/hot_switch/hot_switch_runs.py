"""One run of the hot-switching bench (``python -m bench.hot_switch.hot_switch``): ``hetero-launch`` with its peak RSS, on
this host's loopback or on two emulated testbed nodes, and the switches' times read back from its trace.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import benchlib as B
from bench.hot_switch.hot_switch_config import Config


def switch_times(trace: Path, peers: list[dict[int, set[int]]] | None = None) -> tuple[list[float], list[float]]:
    """Per step (a step begins at its first switch out of home): the seconds rank 0 spent in SWITCH actions,
    waiting for the other rank included, and the switches' own time: for each switch, the longest over the ranks
    of the span from the moment the rank and every rank it exchanges with (``peers``: per switch, each rank's;
    ``hot_switch_predict.switch_peers``) had entered it to the moment it left (the ranks share one host's monotonic
    clock). A rank whose part is local copies only waits for nobody: its own span, as ``switch_seconds`` prices each
    device's work and takes the slowest. Without ``peers`` every rank counts as exchanging with every other: from
    the moment the last rank entered to the moment the last left."""
    from hetero_llm.predict import trace as tracing

    switches = [
        [e for e in record["events"] if e["action"].startswith("SWITCH")] for record in tracing.read_rank_traces(trace)
    ]
    if len({tuple(e["action"] for e in row) for row in switches}) != 1:
        raise RuntimeError(f"ranks of {trace} made different switches")
    if peers is not None and len(peers) != len(switches[0]):
        raise RuntimeError(f"{trace}: {len(switches[0])} switches traced, {len(peers)} planned")
    rank0: list[float] = []
    own: list[float] = []
    home = True  # a step's first switch leaves home (the first bucket with documents may be any)
    ranks = range(len(switches))
    for k, e in enumerate(switches[0]):
        if home:
            rank0.append(0.0)
            own.append(0.0)
        home = e["action"] == "SWITCH>home"
        start = [float(row[k]["start"]) for row in switches]
        end = [float(row[k]["end"]) for row in switches]
        waits = peers[k] if peers is not None else {r: set(ranks) for r in ranks}
        rank0[-1] += end[0] - start[0]
        own[-1] += max(end[r] - max(start[q] for q in {r, *waits[r]}) for r in ranks)
    return rank0, own


_PEAK_WRAPPER = (
    "import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(done.returncode)"
)


def launch_with_peak(
    layout: Path, workdir: Path, trace: Path | None, env: dict[str, str], tb=None
) -> tuple[list[dict], int]:
    """``hetero-launch`` run inside a small wrapper process whose waited-for children are the launcher and its
    ranks, so the wrapper's children's peak RSS is this run's largest process (KiB). ``tb`` (a testbed): one
    ``hetero-launch --node`` per emulated node, each in its node's namespace, rendezvous on the cross-domain
    fabric (the default group's, which switches use)."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "metrics.jsonl"
    cmd = B.launch_command(layout, metrics=metrics, trace=trace or None)
    if tb is None:
        cmd += ["--set", f"cluster.port={B.free_port()}"]
        proc = subprocess.run(
            [sys.executable, "-c", _PEAK_WRAPPER, *cmd],
            capture_output=True,
            text=True,
            timeout=900,
            env=B.clean_env(env),
            cwd=B.ROOT,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        peak = int(proc.stdout.split()[-1])
    else:
        peak = _launch_testbed(tb, cmd, workdir, env)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return rows, peak


def _launch_testbed(tb, cmd: list[str], workdir: Path, env: dict[str, str], timeout_s: float = 900) -> int:
    env = {
        **env,
        "MASTER_ADDR": tb.address("node0", "xdom"),
        "MASTER_PORT": str(B.free_port()),
        "GLOO_SOCKET_IFNAME": "xdom",
        "OMP_NUM_THREADS": "1",
    }
    procs, logs = {}, {}
    try:
        for node in ("node0", "node1"):
            logs[node] = workdir / f"{node}.log"
            with open(logs[node], "w") as log:
                procs[node] = tb.run(
                    node,
                    [sys.executable, "-c", _PEAK_WRAPPER, *cmd, "--node", node],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=B.ROOT,
                )
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs.values()):
            if any(p.returncode not in (None, 0) for p in procs.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = {n: p.returncode for n, p in procs.items() if p.returncode != 0}
    if bad:
        output = "\n".join(f"--- {n}\n{path.read_text()}" for n, path in logs.items())
        raise RuntimeError(f"{' '.join(cmd)} failed on the testbed ({bad}):\n{output}")
    return max(int(path.read_text().split()[-1]) for path in logs.values())


def testbed(cfg: Config):
    """Two emulated nodes of one domain; both fabrics at the TP link's rate (``cfg.tp_gbps``), no added delay."""
    from bench import testbed as T

    fabric = T.FabricSpec(f"{cfg.tp_gbps * 1000:.6g}mbit", "0us")
    spec = T.TestbedSpec(
        (T.EmulatedDomain("d0", fabric),), (T.EmulatedNode("node0", "d0"), T.EmulatedNode("node1", "d0")), fabric
    )
    return T.Testbed(spec, delay=T.DelayMode.NONE)
