"""The testbed's description: domains, nodes, the fabrics between them, and the checks on them."""

from __future__ import annotations

import enum
import re
from typing import Any

import attrs

from hetero_llm.errors import HeteroError


class TestbedError(HeteroError):
    """A bad testbed description, or a host that cannot build one; the message says which and why."""

    __test__ = False


def _doc(text: str, **kw: Any) -> Any:
    return attrs.field(metadata={"doc": text}, **kw)


# --------------------------------------------------------------------------------------------
# Description


class Fabric(str, enum.Enum):
    """Which of a node's two networks: its own domain's fabric, or the cross-domain one."""

    DOMAIN = "domain"
    CROSS = "xdom"

    @property
    def interface(self) -> str:
        """The interface name inside every node namespace (what GLOO_SOCKET_IFNAME takes)."""
        return "dom0" if self is Fabric.DOMAIN else "xdom"


class DelayMode(str, enum.Enum):
    """How a fabric's delay is made: 'auto' picks 'netem' where the kernel has it, else 'relay'; 'none' adds
    no delay (the host stack's own latency only; refused when a fabric declares a delay)."""

    AUTO = "auto"
    NETEM = "netem"
    RELAY = "relay"
    NONE = "none"


@attrs.frozen
class FabricSpec:
    """One switched network: every link into it has this bandwidth and half this delay."""

    bandwidth: str = _doc("rate of each link, each direction, tc units: '1gbit', '100mbit', '500kbit'")
    delay: str = _doc("one-way latency node to node across the fabric: '0.2ms', '5ms', '50us'")

    @property
    def bits_per_s(self) -> int:
        return parse_rate(self.bandwidth, "bandwidth")

    @property
    def delay_s(self) -> float:
        return parse_delay(self.delay, "delay")


@attrs.frozen
class EmulatedDomain:
    """An emulated network domain (e.g. 'ib', 'roce'): its nodes share one shaped fabric. (The layout's
    ``layout.DomainSpec`` describes a real domain; ``holmes_bench.testbed_spec`` makes one of these from it.)"""

    name: str = _doc("domain name, as in the layout ('ib', 'roce', 'eth')")
    fabric: FabricSpec = _doc("the domain's own (fast) fabric")


@attrs.frozen
class EmulatedNode:
    """One host of the emulated cluster."""

    name: str = _doc("node name ('node0'); letters, digits, '_' and '-', at most 32 characters")
    domain: str = _doc("name of the domain the node belongs to")
    speed: float = _doc(
        "relative compute speed (1.0 = full, 0.5 = half), as a label: the testbed does not "
        "slow the node's processes (HETERO_EMULATE_SLOWDOWN does, where a run sets it)",
        default=1.0,
    )


@attrs.frozen
class TestbedSpec:
    """The whole emulated cluster: domains, nodes, and the fabric between domains."""

    __test__ = False

    domains: tuple[EmulatedDomain, ...] = _doc("the domains, in index order (10.77.<index>.0/24)", converter=tuple)
    nodes: tuple[EmulatedNode, ...] = _doc("the nodes, in index order (host byte = index + 1)", converter=tuple)
    cross: FabricSpec = _doc("the cross-domain fabric every node is on (10.78.0.0/24); usually slower")

    def __attrs_post_init__(self) -> None:
        _check_spec(self)

    def domain(self, name: str) -> EmulatedDomain:
        return next(d for d in self.domains if d.name == name)

    def node(self, name: str) -> EmulatedNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise TestbedError(f"testbed: no node {name!r} (nodes: {', '.join(n.name for n in self.nodes)})")


def grid_spec(
    domains: int = 2,
    nodes_per_domain: int = 2,
    bandwidth: str = "1gbit",
    delay: str = "0.2ms",
    cross_bandwidth: str = "100mbit",
    cross_delay: str = "5ms",
) -> TestbedSpec:
    """``domains`` domains of ``nodes_per_domain`` nodes each, all domains on the same fabric settings."""
    fabric = FabricSpec(bandwidth, delay)
    names = [f"d{d}" for d in range(domains)]
    nodes = [
        EmulatedNode(f"node{d * nodes_per_domain + i}", names[d])
        for d in range(domains)
        for i in range(nodes_per_domain)
    ]
    return TestbedSpec(
        tuple(EmulatedDomain(n, fabric) for n in names), tuple(nodes), FabricSpec(cross_bandwidth, cross_delay)
    )


_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")


def parse_rate(text: str, where: str) -> int:
    """'100mbit' -> 100_000_000 (bits per second)."""
    m = _NUMBER_UNIT.match(str(text))
    unit = m.group(2).lower() if m else ""
    if unit.endswith("bps"):
        raise TestbedError(f"{where}: {text!r}: tc reads '{unit}' as bytes per second; write bits, e.g. '100mbit'")
    if not m or unit not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise TestbedError(
            f"{where}: {text!r} is not a rate; write a positive number and one of {', '.join(_RATE_UNITS)} (e.g. '1gbit')"
        )
    return int(float(m.group(1)) * _RATE_UNITS[unit])


def parse_delay(text: str, where: str) -> float:
    """'0.2ms' -> 0.0002 (seconds)."""
    m = _NUMBER_UNIT.match(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _TIME_UNITS:
        raise TestbedError(
            f"{where}: {text!r} is not a delay; write a number and one of {', '.join(_TIME_UNITS)} (e.g. '0.2ms')"
        )
    return float(m.group(1)) * _TIME_UNITS[unit]


def _check_spec(spec: TestbedSpec) -> None:
    for i, d in enumerate(spec.domains):
        parse_rate(d.fabric.bandwidth, f"testbed: domains[{i}].fabric.bandwidth")
        parse_delay(d.fabric.delay, f"testbed: domains[{i}].fabric.delay")
    parse_rate(spec.cross.bandwidth, "testbed: cross.bandwidth")
    parse_delay(spec.cross.delay, "testbed: cross.delay")
    if not spec.nodes:
        raise TestbedError("testbed: nodes: empty (give at least one node)")
    if not 1 <= len(spec.domains) <= 255:
        raise TestbedError(f"testbed: domains: {len(spec.domains)} domains; 1 to 255 fit 10.77.<domain>.0/24")
    if len(spec.nodes) > 253:
        raise TestbedError(f"testbed: nodes: {len(spec.nodes)} nodes; at most 253 fit one /24")
    domain_names = [d.name for d in spec.domains]
    for i, name in enumerate(domain_names):
        if name in domain_names[:i]:
            raise TestbedError(f"testbed: domains[{i}].name: {name!r} appears twice")
    seen: set[str] = set()
    for i, n in enumerate(spec.nodes):
        if not _NODE_NAME.match(n.name):
            raise TestbedError(
                f"testbed: nodes[{i}].name: {n.name!r}; use letters, digits, '_' and '-' (at most 32, no leading '_' or '-')"
            )
        if n.name in seen:
            raise TestbedError(f"testbed: nodes[{i}].name: {n.name!r} appears twice")
        seen.add(n.name)
        if n.domain not in domain_names:
            raise TestbedError(
                f"testbed: nodes[{i}].domain: unknown domain {n.domain!r} (domains: {', '.join(domain_names)})"
            )
        if not n.speed > 0:
            raise TestbedError(f"testbed: nodes[{i}].speed: {n.speed} must be > 0 (1.0 = full speed)")
