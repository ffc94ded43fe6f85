"""The emulated network testbed (bench/testbed/) against its configured bandwidth and delay.

Description checks run anywhere; the rest build namespaces (marked ``netns``): a 2-domain x 2-node
cluster, TCP within and across domains, RTT against the configured delay, throughput across against
the configured rate, and teardown on every exit path.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from bench import testbed

ROOT = Path(__file__).resolve().parents[2]

CROSS_RATE, CROSS_DELAY = "50mbit", "5ms"  # one-way; a round trip crosses four shaped link ends: >= 10 ms


def _cluster(**kw):
    return testbed.grid_spec(
        2, 2, bandwidth="1gbit", delay="0.2ms", cross_bandwidth=CROSS_RATE, cross_delay=CROSS_DELAY, **kw
    )


@pytest.fixture(scope="module")
def netns_ok() -> None:
    ok, why = testbed.available()
    if not ok:
        pytest.skip(
            f"needs root and Linux network namespaces; runs on the CI machine and developer machines of this project ({why})"
        )


@pytest.fixture(scope="module")
def bed(netns_ok):
    with testbed.Testbed(_cluster()) as tb:
        yield tb


@pytest.fixture(scope="module")
def paths(bed):
    """node0 -> node1 inside domain d0, node0 -> node2 across domains."""
    within = testbed.measure(bed, "node0", "node1", "domain", seconds=0.5, rounds=10)
    across = testbed.measure(bed, "node0", "node2", "xdom", seconds=0.5, rounds=10)
    return within, across


def _root_link_names() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def _our_link_names(tb) -> set[str]:
    names = {"dom0", "xdom", "br_x"} | {f"br_d{d}" for d in range(len(tb.spec.domains))}
    for i in range(len(tb.spec.nodes)):
        names |= {f"n{i}{f}{s}" for f in "dx" for s in ("", "q", "b")}
    return names


def _assert_gone(tb) -> None:
    assert testbed.list_namespaces(f"hl_{tb.run_id}") == []
    assert not (_root_link_names() & _our_link_names(tb))


# --------------------------------------------------------------------------- description (anywhere)


def test_addresses_interfaces_and_env_follow_the_description() -> None:
    tb = testbed.Testbed(
        testbed.TestbedSpec(
            domains=[
                testbed.EmulatedDomain("ib", testbed.FabricSpec("1gbit", "0.1ms")),
                testbed.EmulatedDomain("roce", testbed.FabricSpec("10gbit", "50us")),
            ],
            nodes=[
                testbed.EmulatedNode("a", "ib"),
                testbed.EmulatedNode("b", "roce", speed=0.5),
                testbed.EmulatedNode("c", "roce"),
            ],
            cross=testbed.FabricSpec("100mbit", "5ms"),
        ),
        run_id="abc123",
    )
    assert tb.address("a", "domain") == "10.77.0.1"
    assert tb.address("b", testbed.Fabric.DOMAIN) == "10.77.1.2"
    assert tb.address("c", "xdom") == "10.78.0.3"
    assert tb.interface("domain") == "dom0" and tb.interface("xdom") == "xdom"
    assert tb.namespace("b") == "hl_abc123_b" and tb.switch_namespace == "hl_abc123-sw"
    assert tb.peers("b", "domain") == {"b": "10.77.1.2", "c": "10.77.1.3"}
    assert tb.peers("b", "xdom") == {"a": "10.78.0.1", "b": "10.78.0.2", "c": "10.78.0.3"}
    env = tb.env("b")
    assert sorted(env) == ["HETERO_TESTBED_DOMAIN", "HETERO_TESTBED_HOSTS", "HETERO_TESTBED_NODE"]
    assert env["HETERO_TESTBED_NODE"] == "b" and env["HETERO_TESTBED_DOMAIN"] == "roce"
    assert json.loads(env["HETERO_TESTBED_HOSTS"])["dom0"] == {"b": "10.77.1.2", "c": "10.77.1.3"}
    assert tb.fabric("b", "domain").bits_per_s == 10**10 and tb.fabric("b", "xdom").delay_s == pytest.approx(0.005)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(cross_bandwidth="100mbps"),
            "testbed: cross.bandwidth: '100mbps': tc reads 'mbps' as bytes per second; write bits, e.g. '100mbit'",
        ),
        (
            dict(bandwidth="fast"),
            "testbed: domains[0].fabric.bandwidth: 'fast' is not a rate; write a positive number and one of bit, kbit, mbit, gbit, tbit (e.g. '1gbit')",
        ),
        (
            dict(cross_delay="5"),
            "testbed: cross.delay: '5' is not a delay; write a number and one of us, ms, s (e.g. '0.2ms')",
        ),
    ],
)
def test_bad_rates_and_delays_are_named(change, message) -> None:
    args = dict(bandwidth="1gbit", delay="0.2ms", cross_bandwidth="100mbit", cross_delay="5ms") | change
    with pytest.raises(testbed.TestbedError) as err:
        testbed.grid_spec(2, 2, **args)
    assert str(err.value) == message


def test_bad_nodes_are_named() -> None:
    fabric = testbed.FabricSpec("1gbit", "1ms")
    domains = [testbed.EmulatedDomain("ib", fabric)]
    with pytest.raises(
        testbed.TestbedError, match=r"^testbed: nodes\[1\]\.domain: unknown domain 'eth' \(domains: ib\)$"
    ):
        testbed.TestbedSpec(domains, [testbed.EmulatedNode("a", "ib"), testbed.EmulatedNode("b", "eth")], fabric)
    with pytest.raises(testbed.TestbedError, match=r"^testbed: nodes\[1\]\.name: 'a' appears twice$"):
        testbed.TestbedSpec(domains, [testbed.EmulatedNode("a", "ib"), testbed.EmulatedNode("a", "ib")], fabric)
    with pytest.raises(testbed.TestbedError, match=r"^testbed: nodes\[0\]\.speed: 0 must be > 0"):
        testbed.TestbedSpec(domains, [testbed.EmulatedNode("a", "ib", speed=0)], fabric)


def test_cleanup_needs_exactly_one_selector() -> None:
    result = CliRunner().invoke(testbed.main, ["cleanup"])
    assert result.exit_code == 2 and "give exactly one of --all or --run RUN_ID" in result.output


# --------------------------------------------------------------------------- built testbed (root)


@pytest.mark.netns
def test_tcp_works_within_a_domain_and_across_domains(paths) -> None:
    within, across = paths
    for m in (within, across):
        assert m.rtt_s > 0 and m.bits_per_s > 0


@pytest.mark.netns
def test_domain_fabrics_are_isolated_from_each_other(bed) -> None:
    # node0 (domain d0) has no route to node2's domain address: only the cross-domain fabric joins domains.
    code = f"import socket; s = socket.socket(); s.settimeout(2)\ntry: s.connect(('{bed.address('node2', 'domain')}', 5201))\nexcept OSError as e: print(e.errno)"
    proc = bed.run("node0", [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=10)
    assert out.strip() == "101"  # ENETUNREACH


@pytest.mark.netns
def test_round_trip_across_domains_reflects_configured_delay(bed, paths) -> None:
    within, across = paths
    floor = 2 * bed.spec.cross.delay_s  # one-way delay, there and back
    assert floor <= across.rtt_s <= floor + 0.015, (
        f"RTT {across.rtt_s * 1e3:.2f} ms, configured floor {floor * 1e3:.1f} ms"
    )
    assert within.rtt_s < across.rtt_s / 3


@pytest.mark.netns
def test_throughput_across_domains_is_held_to_the_configured_rate(bed, paths) -> None:
    within, across = paths
    rate = bed.spec.cross.bits_per_s
    assert 0.3 * rate <= across.bits_per_s <= 1.2 * rate, (
        f"{across.bits_per_s / 1e6:.1f} Mbit/s across, configured {rate / 1e6:.0f}"
    )
    assert within.bits_per_s >= 3 * across.bits_per_s, (
        f"within {within.bits_per_s / 1e6:.1f} vs across {across.bits_per_s / 1e6:.1f} Mbit/s"
    )


@pytest.mark.netns
def test_processes_see_their_interfaces_addresses_and_node(netns_ok) -> None:
    spec = testbed.TestbedSpec(
        [testbed.EmulatedDomain("ib", testbed.FabricSpec("1gbit", "0.1ms"))],
        [testbed.EmulatedNode("fast", "ib"), testbed.EmulatedNode("slow", "ib", speed=0.5)],
        testbed.FabricSpec("100mbit", "1ms"),
    )
    code = "import os, socket; print(os.environ['HETERO_TESTBED_NODE'], sorted(n for _, n in socket.if_nameindex()))"
    with testbed.Testbed(spec) as tb:
        out = subprocess.run(
            ["ip", "-n", tb.namespace("slow"), "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True
        ).stdout
        assert "dom0    inet 10.77.0.2/24" in out and "xdom    inet 10.78.0.2/24" in out
        proc = tb.run("slow", [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.communicate(timeout=10)[0].strip() == "slow ['dom0', 'lo', 'xdom']"


@pytest.mark.netns
def test_delay_none_shapes_rate_without_a_relay_and_refuses_a_declared_delay(netns_ok) -> None:
    fabric = testbed.FabricSpec("100mbit", "0us")
    spec = testbed.TestbedSpec(
        [testbed.EmulatedDomain("d0", fabric)],
        [testbed.EmulatedNode("a", "d0"), testbed.EmulatedNode("b", "d0")],
        fabric,
    )
    with testbed.Testbed(spec, delay="none") as tb:
        assert tb.delay_mode is testbed.DelayMode.NONE and tb._procs == []  # no relay process
        path = testbed.measure(tb, "a", "b", "domain", seconds=0.5, rounds=10)
        assert 0.3 * fabric.bits_per_s <= path.bits_per_s <= 1.2 * fabric.bits_per_s, path
    with pytest.raises(testbed.TestbedError, match="delay 'none' asked for, but a fabric declares a delay"):
        with testbed.Testbed(_cluster(), delay="none"):
            pass


@pytest.mark.netns
def test_exit_kills_processes_and_removes_namespaces_and_links(netns_ok) -> None:
    with testbed.Testbed(_cluster()) as tb:
        assert len(testbed.list_namespaces(f"hl_{tb.run_id}")) == 5  # four nodes and the switch
        sleeper = tb.run("node3", ["sleep", "60"])
    assert sleeper.poll() is not None
    _assert_gone(tb)


@pytest.mark.netns
def test_teardown_happens_when_the_body_raises(netns_ok) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with testbed.Testbed(_cluster()) as tb:
            sleeper = tb.run("node0", ["sleep", "60"])
            raise RuntimeError("boom")
    assert sleeper.poll() is not None
    _assert_gone(tb)


@pytest.mark.netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_teardown_happens_on_a_signal(netns_ok, sig) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.testbed", "up", "--domains", "1", "--nodes-per-domain", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    first = proc.stdout.readline()  # "testbed <run id>: delay by ..."
    assert first.startswith("testbed "), first + proc.stderr.read()
    run_id = first.split()[1].rstrip(":")
    deadline = time.monotonic() + 10
    while "(Ctrl-C tears down)" not in proc.stdout.readline() and time.monotonic() < deadline:
        pass
    assert len(testbed.list_namespaces(f"hl_{run_id}")) == 3
    proc.send_signal(sig)
    proc.wait(timeout=15)
    assert testbed.list_namespaces(f"hl_{run_id}") == []


@pytest.mark.netns
def test_cleanup_removes_what_a_killed_run_left(netns_ok) -> None:
    run_id = "c1ea40"
    for ns in (f"hl_{run_id}_node0", f"hl_{run_id}-sw"):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    result = CliRunner().invoke(testbed.main, ["cleanup", "--run", run_id])
    assert result.exit_code == 0, result.output
    assert (
        result.output.startswith("removed 2 namespace(s): ")
        and f"hl_{run_id}_node0" in result.output
        and f"hl_{run_id}-sw" in result.output
    )
    assert testbed.list_namespaces(f"hl_{run_id}") == []
