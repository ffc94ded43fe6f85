"""An emulated cluster on one machine: nodes in network domains, joined by shaped links (testing tier 3).

Each emulated **node** is a Linux network namespace with two interfaces:

    dom0   into its domain's fabric        10.77.<domain index>.<node index + 1>/24
    xdom   into the cross-domain fabric    10.78.0.<node index + 1>/24

Each fabric is a Linux bridge inside one extra "switch" namespace, so nothing is added to the root
namespace. Every link is a veth pair shaped on both ends: ``tbf`` holds the fabric's bandwidth in each
direction; the fabric's delay comes from ``netem`` under that ``tbf`` where the kernel has sch_netem,
else from a small relay process in the switch namespace that holds each frame for the delay (slim VM
kernels often ship without netem; the relay costs some CPU and adds tens of microseconds of jitter).
A fabric's ``delay`` is the one-way latency node to node: a frame crosses two links (sender -> switch,
switch -> receiver), each adds half, so a round trip takes at least ``2 * delay``.

There is no default route, so a domain address is reachable only from nodes of that domain, and no
traffic ever leaves the namespaces this module creates. Namespace names are ``hl_<run id>_<node>``
plus ``hl_<run id>-sw``; everything is torn down on exit, on exceptions, on SIGINT/SIGTERM/SIGHUP
and at interpreter exit, and ``cleanup --all`` removes what a killed run left behind.

Compute speed is not emulated here (two cores cannot be split into slower CPUs): a node's ``speed``
only describes it (the node table shows it). A run that wants slower nodes sets the runtime's
``HETERO_EMULATE_SLOWDOWN`` for their processes itself, as ``holmes_bench.py`` does from the layout's speeds.

Library: ``from bench import testbed``; ``with testbed.Testbed(spec) as tb: tb.run(node, argv)``. CLI, from the
repository root: ``python -m bench.testbed demo``.

Modules: ``spec`` (the description and its checks), ``netns`` (``ip``/``tc`` on the host, the namespaces of a
run, shaping, the delay relay, teardown on every exit path), ``bed`` (``Testbed``: addresses, processes on
the nodes, build and teardown), ``tcp_probe`` (RTT and goodput of a path), ``cli`` (the command line).
"""

from bench.testbed.bed import Testbed
from bench.testbed.cli import format_measurements, format_nodes, main
from bench.testbed.netns import PREFIX, available, cleanup, list_namespaces, relay
from bench.testbed.spec import (
    DelayMode,
    EmulatedDomain,
    EmulatedNode,
    Fabric,
    FabricSpec,
    TestbedError,
    TestbedSpec,
    grid_spec,
    parse_delay,
    parse_rate,
)
from bench.testbed.tcp_probe import PROBE_PORT, PathMeasurement, measure

__all__ = [
    "PREFIX",
    "PROBE_PORT",
    "DelayMode",
    "EmulatedDomain",
    "EmulatedNode",
    "Fabric",
    "FabricSpec",
    "PathMeasurement",
    "Testbed",
    "TestbedError",
    "TestbedSpec",
    "available",
    "cleanup",
    "format_measurements",
    "format_nodes",
    "grid_spec",
    "list_namespaces",
    "main",
    "measure",
    "parse_delay",
    "parse_rate",
    "relay",
]
