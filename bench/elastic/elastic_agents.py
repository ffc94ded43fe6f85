"""Emulated nodes of an elastic run on one machine: one torchrun elastic agent per node of a cluster file, each in
its own process group, killed or stopped whole (its agent and the workers it started), and the lines the run
prints. Shared by bench/elastic/elastic.py and tests/unit/test_elastic.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import attrs

from bench.common import benchlib as B
from hetero_llm.launch import in_place

ROUND = "elastic: nodes "  # the line each round's torchrun rank 0 prints (launch/elastic.py)
DROP = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "HETERO_NODE",
    "HETERO_EMULATE_SLOWDOWN",
)


@attrs.frozen
class Emulated:
    """How the emulated nodes of a cluster file are declared: each node's emulated device speed (GFLOP/s, the
    planner's ``[plan.kinds]`` priced by FLOPs, the runtime's ``HETERO_EMULATE_DEVICE``), each node's address
    (``host``; empty: this machine) and the network they share (one domain: Gbit/s, one-way us, gloo's interface)."""

    gflops: dict[str, float]
    hosts: dict[str, str] = attrs.field(factory=dict)
    link: tuple[float, float] = (10.0, 20.0)
    ifname: str = ""

    def device(self, node: str) -> str:
        """``HETERO_EMULATE_DEVICE`` for every rank a node's workers run."""
        return f"*:gflops={self.gflops[node]!r}"

    def sections(self, nodes: Iterable[str]) -> tuple[str, str]:
        """The text the nodes ``nodes`` add to ``[cluster]`` (the domain) and to ``[plan]`` (a kind per node)."""
        gbps, us = self.link
        ifname = f'gloo_ifname = "{self.ifname}"\n' if self.ifname else ""
        domain = f'[[cluster.domains]]\nname = "lan"\nkind = "ethernet"\nbandwidth_gbps = {gbps!r}\n'
        domain += f"latency_us = {us!r}\n{ifname}"
        plan = "[plan.nodes]\n" + "".join(f'{n} = "emu-{n}"\n' for n in nodes)
        for n in nodes:  # pricing "flops": exactly the durations HETERO_EMULATE_DEVICE gives (predict/device.py)
            plan += f"[plan.kinds.emu-{n}]\ntflops = {self.gflops[n] / 1e3!r}\nmemory_gb = 8\nlink_gbps = 10\n"
            plan += 'mem_bw_gbs = 10\npricing = "flops"\n'
        return domain, plan


def cluster_text(
    common: str,
    nodes: dict[str, int],
    steps: int,
    port: int,
    max_tp: int | None = None,
    emulated: Emulated | None = None,
) -> str:
    """A cluster file: ``common``'s [model]/[train]/[data] (train.steps set), a CPU node per ``nodes`` entry
    (name -> devices), a small planner budget; ``max_tp``: the planner's ``[plan] max_tp`` (None: its default,
    so a node's two devices may form a TP group); ``emulated``: the nodes' emulated speeds, addresses and network
    (None: nodes of the catalogue's ``cpu`` kind on this machine)."""
    lines = [line for line in common.splitlines() if not line.startswith("steps = ")]
    common = "\n".join(lines).replace("[train]", f"[train]\nsteps = {steps}")
    cpus = {n: ", ".join(['"cpu"'] * k) for n, k in nodes.items()}
    hosts = emulated.hosts if emulated else {}
    where = {
        n: (f'host = "{hosts[n]}"\n' if n in hosts else "") + ('domain = "lan"\n' if emulated else "") for n in nodes
    }
    listed = "".join(f'[[cluster.nodes]]\nname = "{n}"\n{where[n]}devices = [{cpus[n]}]\n' for n in nodes)
    domain, kinds = emulated.sections(nodes) if emulated else ("", "")
    tp = f"max_tp = {max_tp}\n" if max_tp is not None else ""
    return f"{common}\n[cluster]\ntimeout_s = 10\nport = {port}\n{listed}{domain}\n[plan]\nmax_evals = 200\n{tp}{kinds}"


def start_agent(
    cluster: Path,
    node: str,
    devices: int,
    rdzv: int,
    workdir: Path,
    slowdown: float = 8.0,
    saves: tuple = (1, 0),
    max_restarts: int = 6,
    shm: Path | None = None,
    device: str | None = None,
    where: Where | None = None,
) -> subprocess.Popen:
    """One node's torchrun agent, its output in ``workdir/NODE.NANOS.log``; ``slowdown``: its devices' emulated
    speed (HETERO_EMULATE_SLOWDOWN for every rank its workers run: sleeps only, the numbers do not change);
    ``saves``: (--checkpoint-every, --snapshot-every); ``max_restarts``: torchrun's ``--max-restarts``; ``shm``: the
    snapshots' HETERO_SHM_DIR (None: /dev/shm); ``device``: HETERO_EMULATE_DEVICE instead of ``slowdown`` (an
    emulated device: every compute action lasts its modelled time); ``where``: the agent's network namespace and
    addresses (None: this machine's loopback, ``rdzv`` on 127.0.0.1)."""
    env = {k: v for k, v in os.environ.items() if k not in DROP and not k.startswith("TORCHELASTIC_")}
    tmp = workdir / "tmp"  # torchrun's log folders (a killed agent cannot remove its own): removed with workdir
    tmp.mkdir(exist_ok=True)
    env.update(TMPDIR=str(tmp), OMP_NUM_THREADS="1", HETERO_NODE=node, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if device is None:
        env["HETERO_EMULATE_SLOWDOWN"] = f"*:{slowdown}"
    else:
        env["HETERO_EMULATE_DEVICE"] = device
    where = where or Where()
    if shm is not None:
        env["HETERO_SHM_DIR"] = str(shm)
    cmd = [
        *where.prefix,
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        str(devices),
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{where.rdzv_host}:{rdzv}",
        "--rdzv-id",
        "elastic",
        "--rdzv-conf",
        "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5" + where.is_host,
        *(("--local-addr", where.local_addr) if where.local_addr else ()),
        *B.launch_command(
            cluster,
            python=None,
            quiet=False,
            metrics=workdir / "m.jsonl",
            args=[
                "--elastic",
                "--checkpoint",
                str(workdir / "ckpt"),
                "--checkpoint-every",
                str(saves[0]),
                "--snapshot-every",
                str(saves[1]),
            ],
        ),
    ]
    with open(workdir / f"{node}.{time.monotonic_ns()}.log", "w") as log:  # the agent keeps its own descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@attrs.frozen
class Where:
    """Where a node's agent runs: ``prefix`` before its command (``ip netns exec NS``: a namespace of the testbed),
    the rendezvous' host, whether this agent serves it (``,is_host=1`` / ``,is_host=0``; empty: torch guesses from
    the address), and the address the agent advertises (``--local-addr``: its workers' MASTER_ADDR when it is rank
    0; empty: the host name)."""

    prefix: tuple[str, ...] = ()
    rdzv_host: str = "127.0.0.1"
    is_host: str = ""
    local_addr: str = ""


def listening(port: int) -> bool:
    """Whether a socket of this machine listens on TCP ``port`` (/proc/net/tcp, tcp6: read, nothing connects)."""
    return any(state == in_place.LISTEN and local == port for _, state, local, _ in in_place.tcp_sockets())


def wait_serving(agent: subprocess.Popen, port: int, timeout: float = 300) -> None:
    """Until ``agent`` (the first one started) serves torchrun's rendezvous on ``port``: an agent started later
    finds the port taken and joins as a client, however long the first took to import torch on a loaded machine
    (a fixed head start is not enough there, and an agent killed as a lost node must not be the store's host)."""
    deadline = time.monotonic() + timeout
    while not listening(port):
        if agent.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the first agent never served the rendezvous on port {port} (exit {agent.poll()})")
        time.sleep(0.05)


def children(parent: int) -> list[int]:
    """The pids whose parent is ``parent`` (torch starts an agent's workers in sessions of their own)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


def signal_node(agent: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to a node: its agent and its workers (SIGKILL: a lost node, reaped here; SIGSTOP: a hung one)."""
    for pid in [agent.pid, *children(agent.pid)]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    if sig == signal.SIGKILL:
        agent.wait()


def rounds(workdir: Path) -> list[str]:
    """Every round line of every agent's log, in the order of the step each round starts at (rounds of one run
    start at steps that never go down; the agents' logs are read in the order they started)."""
    lines = []
    for log in sorted(workdir.glob("*.log"), key=lambda p: int(p.name.split(".")[1])):
        lines += [line for line in log.read_text().splitlines() if line.startswith(ROUND)]
    return sorted(lines, key=start_step)


def start_step(line: str) -> int:
    """The step a round line says it starts at."""
    return int(line.split(" at step ")[1].split()[0])


def members(line: str) -> str:
    """``n0, n1`` of a round line."""
    return line.removeprefix(ROUND).split(" (")[0]
