"""Multi-host launches on the emulated testbed (bench/testbed/): every node is a network namespace with
its own address, as separate machines would be. Needs root and network namespaces (skipped otherwise).

The layout puts rank 0 on node1 while node0 is the master: the ranks look for the rendezvous at node0's
address, so node0's lowest rank (rank 1) must serve it there. Started per node (each node finds its own
ranks by its address) and per rank, it trains what one local launch of the same model trains.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import testbed
from harness import free_port, launch, rank0_off_master_layout

pytestmark = [pytest.mark.netns, pytest.mark.multiprocess]


def _layout(path: Path, hosts: tuple[str, str]) -> Path:
    return rank0_off_master_layout(path, hosts, timeout_s=30)


@pytest.fixture(scope="module")
def bed():
    ok, why = testbed.available()
    if not ok:
        pytest.skip(f"needs root and Linux network namespaces; runs on the CI machine and developer machines ({why})")
    with testbed.Testbed(testbed.grid_spec(1, 2, cross_bandwidth="1gbit", cross_delay="0.2ms")) as tb:
        yield tb


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("local")
    return launch(_layout(d / "local.toml", ("127.0.0.1", "127.0.0.1")), d)


def _hosts(tb) -> tuple[str, str]:
    return tb.address("node0", "xdom"), tb.address("node1", "xdom")


def _run(
    tb, starts: list[tuple[str, list[str]]], metrics: Path, timeout: float = 120, quiet: bool = True
) -> list[tuple[int, str]]:
    """Start each (node, extra args) in its namespace; wait for all; return (exit code, output) of each."""
    env = {"GLOO_SOCKET_IFNAME": "xdom", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "", "MASTER_PORT": ""}
    procs = [
        tb.run(
            node,
            [sys.executable, "-m", "hetero_llm.cli", *args, *["--quiet"] * quiet, "--metrics-jsonl", str(metrics)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node, args in starts
    ]
    return [(p.wait(timeout), p.stdout.read()) for p in procs]


def _losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def test_per_node_launch_with_rank0_off_the_master_node(bed, reference, tmp_path):
    layout = _layout(tmp_path / "l.toml", _hosts(bed))
    port = f"cluster.port={free_port()}"
    # no --node: each namespace finds its node by its own address
    results = _run(
        bed,
        [("node1", [str(layout), "--set", port]), ("node0", [str(layout), "--set", port])],
        tmp_path / "m.jsonl",
        quiet=False,
    )
    assert [code for code, _ in results] == [0, 0], results
    assert "starting 1 of 2 ranks here: [0]" in results[0][1] and "starting 1 of 2 ranks here: [1]" in results[1][1]
    assert _losses(tmp_path / "m.jsonl") == reference.losses


def test_per_rank_launch_with_rank0_off_the_master_node(bed, reference, tmp_path):
    layout = _layout(tmp_path / "l.toml", _hosts(bed))
    port = f"cluster.port={free_port()}"
    results = _run(
        bed,
        [
            ("node1", [str(layout), "--rank", "0", "--set", port]),
            ("node0", [str(layout), "--rank", "1", "--set", port]),
        ],
        tmp_path / "m.jsonl",
    )
    assert [code for code, _ in results] == [0, 0], results
    assert _losses(tmp_path / "m.jsonl") == reference.losses


def test_store_listens_on_the_masters_address_only(bed, tmp_path):
    """While the server rank waits for the others, its port answers on node0's xdom address, not on dom0."""
    layout = _layout(tmp_path / "l.toml", _hosts(bed))
    port = free_port()
    server = bed.run(
        "node0",
        [
            sys.executable,
            "-m",
            "hetero_llm.cli",
            str(layout),
            "--rank",
            "1",
            "--quiet",
            "--set",
            f"cluster.port={port}",
            "--set",
            "cluster.timeout_s=20",
        ],
        env={"MASTER_ADDR": "", "MASTER_PORT": ""},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    code = (
        "import socket, sys, time\n"
        "def ok(a):\n"
        "    try:\n"
        f"        socket.create_connection((a, {port}), timeout=2).close(); return 'open'\n"
        "    except OSError as e: return type(e).__name__\n"
        f"for _ in range(200):\n    if ok('{bed.address('node0', 'xdom')}') == 'open': break\n    time.sleep(0.1)\n"
        f"print(ok('{bed.address('node0', 'xdom')}'), ok('{bed.address('node0', 'domain')}'))"
    )
    try:
        probe = bed.run("node1", [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert probe.communicate(timeout=60)[0].split() == ["open", "ConnectionRefusedError"]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)


def _torchrun(bed, node_ranks: dict[str, int], master: str, layout: Path, metrics: Path) -> list[tuple[int, str]]:
    """``torchrun --nnodes 2 --nproc-per-node 1 --node-rank N`` in each node's namespace."""
    port = str(free_port())
    starts = [
        (
            node,
            [
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(n),
                "--master-addr",
                bed.address(master, "xdom"),
                "--master-port",
                port,
                "-m",
                "hetero_llm.cli",
                str(layout),
            ],
        )
        for node, n in node_ranks.items()
    ]
    env = {"GLOO_SOCKET_IFNAME": "xdom", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "", "MASTER_PORT": ""}
    procs = [
        bed.run(
            node,
            [sys.executable, *args, "--quiet", "--metrics-jsonl", str(metrics)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node, args in starts
    ]
    return [(p.wait(180), p.stdout.read()) for p in procs]


def test_torchrun_on_two_hosts(bed, reference, tmp_path):
    """torchrun numbers node by node: node1 (rank 0's node) is torchrun's node 0 and serves its store."""
    layout = _layout(tmp_path / "l.toml", _hosts(bed))
    results = _torchrun(bed, {"node1": 0, "node0": 1}, "node1", layout, tmp_path / "m.jsonl")
    assert [code for code, _ in results] == [0, 0], results
    assert _losses(tmp_path / "m.jsonl") == reference.losses


def test_torchrun_rank_on_the_wrong_host_is_one_line(bed, tmp_path):
    layout = _layout(tmp_path / "l.toml", _hosts(bed))
    results = _torchrun(bed, {"node0": 0, "node1": 1}, "node0", layout, tmp_path / "m.jsonl")
    assert all(code != 0 for code, _ in results), results
    expected = (
        f"error: {layout}: cluster.nodes[1].host: torchrun started rank 0 (RANK) on {socket.gethostname()}, "
        f"but the layout puts it (node1:0) on node node1, host '{bed.address('node1', 'xdom')}', which is not "
        "this machine; give each node its machine's host, and start ranks so that each machine gets its nodes' "
        "ranks (--dry-run lists them)"
    )
    assert [line for line in results[0][1].splitlines() if line.startswith("error: ")] == [expected], results[0][1]


def test_stopped_rank_on_another_host_is_named_on_both(bed, tmp_path):
    """SIGSTOP rank 0 (node1): node0's rank gives up on it by its heartbeat, node1's launcher by its state."""
    layout = _layout(tmp_path / "l.toml", _hosts(bed))
    metrics, port = tmp_path / "m.jsonl", free_port()
    env = {"GLOO_SOCKET_IFNAME": "xdom", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "", "MASTER_PORT": ""}
    procs = {
        node: bed.run(
            node,
            [
                sys.executable,
                "-m",
                "hetero_llm.cli",
                str(layout),
                "--quiet",
                "--metrics-jsonl",
                str(metrics),
                "--set",
                f"cluster.port={port}",
                "--set",
                "cluster.timeout_s=4",
                "--set",
                "train.steps=100000",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in ("node0", "node1")
    }
    try:
        for _ in range(1200):
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            assert all(p.poll() is None for p in procs.values()), [p.communicate() for p in procs.values()]
            time.sleep(0.1)
        rank0 = int(subprocess.run(["pgrep", "-P", str(procs["node1"].pid)], capture_output=True, text=True).stdout)
        os.kill(rank0, signal.SIGSTOP)
        errs = {node: p.communicate(timeout=60)[1] for node, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs.values()] == [1, 1]
    errs = {node: err.strip().splitlines()[-1] for node, err in errs.items()}  # after c10d's hostname warnings
    assert errs["node0"].startswith("error: rank 0 (node1:0) stopped responding: no heartbeat for "), errs["node0"]
    assert errs["node1"].startswith(
        "error: rank 0 (node1:0) stopped responding: its process has been stopped (SIGSTOP) for "
    ), errs["node1"]
