"""Multi-host launches on the emulated testbed (bench/testbed.py): every node is a network namespace with
its own address, as separate machines would be. Needs root and network namespaces (skipped otherwise).

The layout puts rank 0 on node1 while node0 is the master: the ranks look for the rendezvous at node0's
address, so node0's lowest rank (rank 1) must serve it there. Started per node (each node finds its own
ranks by its address) and per rank, it trains what one local launch of the same model trains.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness import free_port, launch, rank0_off_master_layout

BENCH = Path(__file__).resolve().parent.parent / "bench"
if "testbed" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("testbed", BENCH / "testbed.py")
    sys.modules["testbed"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["testbed"])
testbed = sys.modules["testbed"]

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


def _run(tb, starts: list[tuple[str, list[str]]], metrics: Path, timeout: float = 120,
         quiet: bool = True) -> list[tuple[int, str]]:
    """Start each (node, extra args) in its namespace; wait for all; return (exit code, output) of each."""
    env = {"GLOO_SOCKET_IFNAME": "xdom", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "", "MASTER_PORT": ""}
    procs = [tb.run(node, [sys.executable, "-m", "hetero_llm.cli", *args, *["--quiet"] * quiet,
                                "--metrics-jsonl", str(metrics)],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node, args in starts]
    return [(p.wait(timeout), p.stdout.read()) for p in procs]


def _losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def test_per_node_launch_with_rank0_off_the_master_node(bed, reference, tmp_path):
    layout = _layout(tmp_path / "l.toml", _hosts(bed))
    port = f"cluster.port={free_port()}"
    # no --node: each namespace finds its node by its own address
    results = _run(bed, [("node1", [str(layout), "--set", port]), ("node0", [str(layout), "--set", port])],
                   tmp_path / "m.jsonl", quiet=False)
    assert [code for code, _ in results] == [0, 0], results
    assert "starting 1 of 2 ranks here: [0]" in results[0][1] and "starting 1 of 2 ranks here: [1]" in results[1][1]
    assert _losses(tmp_path / "m.jsonl") == reference.losses


def test_per_rank_launch_with_rank0_off_the_master_node(bed, reference, tmp_path):
    layout = _layout(tmp_path / "l.toml", _hosts(bed))
    port = f"cluster.port={free_port()}"
    results = _run(bed, [("node1", [str(layout), "--rank", "0", "--set", port]),
                         ("node0", [str(layout), "--rank", "1", "--set", port])], tmp_path / "m.jsonl")
    assert [code for code, _ in results] == [0, 0], results
    assert _losses(tmp_path / "m.jsonl") == reference.losses


def test_store_listens_on_the_masters_address_only(bed, tmp_path):
    """While the server rank waits for the others, its port answers on node0's xdom address, not on dom0."""
    layout = _layout(tmp_path / "l.toml", _hosts(bed))
    port = free_port()
    server = bed.run("node0", [sys.executable, "-m", "hetero_llm.cli", str(layout), "--rank", "1", "--quiet",
                               "--set", f"cluster.port={port}", "--set", "cluster.timeout_s=20"],
                     env={"MASTER_ADDR": "", "MASTER_PORT": ""}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     text=True)
    code = ("import socket, sys, time\n"
            "def ok(a):\n"
            "    try:\n"
            f"        socket.create_connection((a, {port}), timeout=2).close(); return 'open'\n"
            "    except OSError as e: return type(e).__name__\n"
            f"for _ in range(200):\n    if ok('{bed.address('node0', 'xdom')}') == 'open': break\n    time.sleep(0.1)\n"
            f"print(ok('{bed.address('node0', 'xdom')}'), ok('{bed.address('node0', 'domain')}'))")
    try:
        probe = bed.run("node1", [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert probe.communicate(timeout=60)[0].split() == ["open", "ConnectionRefusedError"]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
