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

Library: ``with Testbed(spec) as tb: tb.run(node, argv)``. CLI: ``python bench/testbed.py demo``.
"""

from __future__ import annotations

import atexit
import collections
import enum
import json
import os
import re
import secrets
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import click

from hetero_llm.errors import HeteroError

PREFIX = "hl_"
THIS_FILE = str(Path(__file__).resolve())
PROBE_PORT = 5201


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
    speed: float = _doc("relative compute speed (1.0 = full, 0.5 = half), as a label: the testbed does not "
                        "slow the node's processes (HETERO_EMULATE_SLOWDOWN does, where a run sets it)", default=1.0)


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


# --------------------------------------------------------------------------------------------
# Host commands


def _sh(command: str, *tail: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``command`` (split on spaces) plus ``tail`` (verbatim); failures name the command and its stderr."""
    argv = [*command.split(), *tail]
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise TestbedError(f"testbed: `{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    out = _sh("ip netns list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def _delete_namespaces(names: list[str]) -> None:
    """Kill every process inside, then delete (which destroys the veths and bridges they hold)."""
    for ns in names:
        for pid in _sh(f"ip netns pids {ns}", check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for ns in names:
        _sh(f"ip netns del {ns}", check=False)


def cleanup(run_id: str | None = None) -> list[str]:
    """Remove the namespaces of one run (``run_id``), or every ``hl_`` namespace; returns their names."""
    names = list_namespaces()
    if run_id is not None:
        names = [n for n in names if n.startswith((f"{PREFIX}{run_id}_", f"{PREFIX}{run_id}-"))]
    _delete_namespaces(names)
    return names


_PROBE: tuple[bool, str, bool] | None = None


def _probe_host() -> tuple[bool, str, bool]:
    """(usable, why, has netem), found once per process by building a throwaway namespace."""
    global _PROBE
    if _PROBE is not None:
        return _PROBE
    if not sys.platform.startswith("linux"):
        _PROBE = (False, f"not Linux ({sys.platform})", False)
    elif os.geteuid() != 0:
        _PROBE = (False, "not root (network namespaces need CAP_NET_ADMIN)", False)
    elif not (_which("ip") and _which("tc")):
        _PROBE = (False, "iproute2 missing (apt-get install -y iproute2)", False)
    else:
        ns = f"{PREFIX}{secrets.token_hex(3)}-probe"
        try:
            for command in (
                f"ip netns add {ns}",
                f"ip -n {ns} link add probe0 type veth peer name probe1",
                f"ip -n {ns} link add probebr type bridge",
                f"tc -n {ns} qdisc add dev probe0 root handle 1: tbf rate 1mbit burst 98304 latency 20ms",
            ):
                done = _sh(command, check=False)
                if done.returncode != 0:
                    _PROBE = (False, f"`{command}` failed: {done.stderr.strip()}", False)
                    break
            else:
                netem = _sh(f"tc -n {ns} qdisc add dev probe0 parent 1:1 handle 10: netem delay 1ms", check=False)
                has_netem = netem.returncode == 0
                how = "netem" if has_netem else "a relay process (this kernel has no sch_netem)"
                _PROBE = (True, f"namespaces, veth, bridge and tc tbf work; delay by {how}", has_netem)
        finally:
            _sh(f"ip netns del {ns}", check=False)
    return _PROBE


def _which(name: str) -> bool:
    return any(os.access(os.path.join(p, name), os.X_OK) for p in os.environ.get("PATH", "").split(os.pathsep))


def available() -> tuple[bool, str]:
    """Whether this host can build a testbed (root, ``ip netns``, veth, bridge, tc tbf), and why not."""
    ok, why, _ = _probe_host()
    return ok, why


# --------------------------------------------------------------------------------------------
# Teardown on every exit path

_ACTIVE: set[Testbed] = set()
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_saved_handlers: dict[int, Any] = {}


def _close_all() -> None:
    for tb in list(_ACTIVE):
        tb.close()


def _on_signal(signum: int, frame: Any) -> None:
    # Tear down first: the signal may land where no `with` is unwinding (a finally that swallows, a thread join).
    _close_all()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def _register(tb: Testbed) -> None:
    if not _ACTIVE and threading.current_thread() is threading.main_thread():
        for sig in _SIGNALS:
            _saved_handlers[sig] = signal.signal(sig, _on_signal)
    _ACTIVE.add(tb)


def _unregister(tb: Testbed) -> None:
    _ACTIVE.discard(tb)
    if not _ACTIVE and _saved_handlers and threading.current_thread() is threading.main_thread():
        for sig, handler in _saved_handlers.items():
            signal.signal(sig, handler)
        _saved_handlers.clear()


atexit.register(_close_all)


# --------------------------------------------------------------------------------------------
# The testbed


class Testbed:
    """Builds the namespaces, bridges and shaped links of ``spec``; a context manager.

    ``with Testbed(spec) as tb:`` builds (or raises ``TestbedError`` having removed what it built);
    leaving the block, an exception, SIGINT/SIGTERM/SIGHUP and interpreter exit all tear down: the
    processes started with ``run`` are killed, then every namespace of this run is deleted.
    """

    __test__ = False

    def __init__(self, spec: TestbedSpec, delay: DelayMode | str = DelayMode.AUTO, run_id: str | None = None):
        self.spec = spec
        self.requested_delay = DelayMode(delay)
        self.delay_mode: DelayMode | None = None  # resolved by build()
        self.run_id = run_id or secrets.token_hex(3)
        self._procs: list[subprocess.Popen] = []
        self._built = False

    # -- names and addresses

    @property
    def switch_namespace(self) -> str:
        return f"{PREFIX}{self.run_id}-sw"

    def namespace(self, node: str) -> str:
        return f"{PREFIX}{self.run_id}_{self.spec.node(node).name}"

    def namespaces(self) -> list[str]:
        return [self.switch_namespace] + [self.namespace(n.name) for n in self.spec.nodes]

    def _index(self, node: str) -> int:
        return self.spec.nodes.index(self.spec.node(node))

    def _domain_index(self, node: str) -> int:
        domain = self.spec.node(node).domain
        return next(i for i, d in enumerate(self.spec.domains) if d.name == domain)

    def address(self, node: str, fabric: Fabric | str) -> str:
        """The node's IPv4 address on ``fabric`` ('domain' -> 10.77.<d>.<n>, 'xdom' -> 10.78.0.<n>)."""
        host = self._index(node) + 1
        if Fabric(fabric) is Fabric.DOMAIN:
            return f"10.77.{self._domain_index(node)}.{host}"
        return f"10.78.0.{host}"

    @staticmethod
    def interface(fabric: Fabric | str) -> str:
        """Interface name for ``fabric`` inside every node namespace: 'dom0' or 'xdom'."""
        return Fabric(fabric).interface

    def peers(self, node: str, fabric: Fabric | str) -> dict[str, str]:
        """Name -> address of every node ``node`` reaches on ``fabric`` (itself included)."""
        fabric = Fabric(fabric)
        domain = self.spec.node(node).domain
        return {
            n.name: self.address(n.name, fabric)
            for n in self.spec.nodes
            if fabric is Fabric.CROSS or n.domain == domain
        }

    def speed(self, node: str) -> float:
        return self.spec.node(node).speed

    def fabric(self, node: str, fabric: Fabric | str) -> FabricSpec:
        return (
            self.spec.domain(self.spec.node(node).domain).fabric if Fabric(fabric) is Fabric.DOMAIN else self.spec.cross
        )

    def env(self, node: str) -> dict[str, str]:
        """The variables ``run`` sets for a process on ``node``."""
        hosts = {f.interface: self.peers(node, f) for f in Fabric}
        return {
            "HETERO_TESTBED_NODE": node,
            "HETERO_TESTBED_DOMAIN": self.spec.node(node).domain,
            "HETERO_TESTBED_HOSTS": json.dumps(hosts, separators=(",", ":")),
        }

    # -- processes

    def run(self, node: str, argv: list[str], env: dict[str, str] | None = None, **popen_kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace, in its own process group (killed at teardown).

        The environment is this process's, plus ``env(node)``, plus ``env``.
        """
        if not self._built:
            raise TestbedError("testbed: run() before build(); use `with Testbed(spec) as tb:`")
        full_env = {**os.environ, **self.env(node), **(env or {})}
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(node), *argv], env=full_env, start_new_session=True, **popen_kw
        )
        self._procs.append(proc)
        return proc

    def _kill_processes(self, grace_s: float = 1.0) -> None:
        live = [p for p in self._procs if p.poll() is None]
        for p in live:
            _killpg(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _killpg(p, signal.SIGKILL)
                p.wait()
        self._procs.clear()

    # -- build and teardown

    def __enter__(self) -> Testbed:
        self.build()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def build(self) -> None:
        ok, why, has_netem = _probe_host()
        if not ok:
            raise TestbedError(f"testbed: cannot build here: {why}")
        mode = self.requested_delay
        if mode is DelayMode.AUTO:
            mode = DelayMode.NETEM if has_netem else DelayMode.RELAY
        if mode is DelayMode.NETEM and not has_netem:
            raise TestbedError(
                "testbed: delay 'netem' asked for, but this kernel has no sch_netem (use 'relay' or 'auto')"
            )
        fabrics = [*(d.fabric for d in self.spec.domains), self.spec.cross]
        if mode is DelayMode.NONE and any(f.delay_s > 0 for f in fabrics):
            raise TestbedError("testbed: delay 'none' asked for, but a fabric declares a delay (set it to '0ms', or "
                               "use 'auto')")
        clash = [n for n in list_namespaces(f"{PREFIX}{self.run_id}") if n in self.namespaces()]
        if clash:
            raise TestbedError(f"testbed: run id {self.run_id!r} is in use ({', '.join(clash)}); pick another")
        self.delay_mode = mode
        _register(self)
        self._built = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        sw = self.switch_namespace
        for ns in self.namespaces():
            _sh(f"ip netns add {ns}")
            # No IPv6: no router/neighbour chatter on the fabrics, and gloo cannot pick a link-local address.
            off = "echo 1 > /proc/sys/net/ipv6/conf/{}/disable_ipv6"
            _sh(f"ip netns exec {ns} sh -c", f"{off.format('all')}; {off.format('default')}")
            _sh(f"ip -n {ns} link set lo up")
        cross_bridge, domain_bridges = "br_x", [f"br_d{d}" for d in range(len(self.spec.domains))]
        for br in [cross_bridge, *domain_bridges]:
            _sh(f"ip -n {sw} link add {br} type bridge")
            _sh(f"ip -n {sw} link set {br} up")
        relay_pairs = []
        for i, node in enumerate(self.spec.nodes):
            ns = self.namespace(node.name)
            for fabric in Fabric:
                spec = self.fabric(node.name, fabric)
                bridge = cross_bridge if fabric is Fabric.CROSS else domain_bridges[self._domain_index(node.name)]
                port = f"n{i}{'d' if fabric is Fabric.DOMAIN else 'x'}"  # switch end of the node's link
                iface = fabric.interface
                _sh(f"ip -n {sw} link add {port} type veth peer name {iface} netns {ns}")
                _sh(f"ip -n {ns} addr add {self.address(node.name, fabric)}/24 dev {iface}")
                _sh(f"ip -n {ns} link set {iface} up")
                if self.delay_mode is DelayMode.RELAY:
                    # port <-(relay: delay)-> port+"q" <-veth-> port+"b" in the bridge
                    _sh(f"ip -n {sw} link add {port}q type veth peer name {port}b")
                    _sh(f"ip -n {sw} link set {port}b master {bridge} up")
                    _sh(f"ip -n {sw} link set {port}q up")
                    _sh(f"ip -n {sw} link set {port} up")
                    relay_pairs.append(f"{port},{port}q,{spec.delay_s / 2!r}")
                else:
                    _sh(f"ip -n {sw} link set {port} master {bridge} up")
                _shape(ns, iface, spec, netem=self.delay_mode is DelayMode.NETEM)
                _shape(sw, port, spec, netem=self.delay_mode is DelayMode.NETEM)
        if relay_pairs:
            self._start_relay(relay_pairs)

    def _start_relay(self, pairs: list[str]) -> None:
        argv = [sys.executable, THIS_FILE, "relay", *[a for p in pairs for a in ("--pair", p)]]
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.switch_namespace, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._procs.append(proc)
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "ready":
            proc.kill()
            raise TestbedError(
                f"testbed: the delay relay did not start: {(line + proc.stderr.read()).strip() if proc.stderr else line}"
            )

    def close(self) -> None:
        """Kill this run's processes and delete its namespaces; safe to call twice, and on a partial build."""
        if not self._built:
            return
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)  # a second Ctrl-C must not cut teardown short
        try:
            self._kill_processes()
            _delete_namespaces([ns for ns in self.namespaces() if ns in list_namespaces(f"{PREFIX}{self.run_id}")])
            self._built = False
            _unregister(self)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _killpg(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _shape(ns: str, dev: str, spec: FabricSpec, netem: bool) -> None:
    """Egress of ``dev``: tbf at the fabric's rate, and (netem) half the fabric's delay under it."""
    rate = spec.bits_per_s
    # The bucket must hold one 64 KiB GSO frame, or tbf splits every TSO frame into MTU-sized ones.
    burst = max(96 * 1024, rate // 8 // 1000)
    _sh(f"tc -n {ns} qdisc add dev {dev} root handle 1: tbf rate {rate}bit burst {burst} latency 50ms")
    if netem:
        half_us = max(1, round(spec.delay_s / 2 * 1e6))
        _sh(f"tc -n {ns} qdisc add dev {dev} parent 1:1 handle 10: netem delay {half_us}us limit 100000")


# --------------------------------------------------------------------------------------------
# Delay relay (runs inside the switch namespace when the kernel has no netem)

_ETH_P_ALL = 0x0003
_SOL_PACKET = 263
_PACKET_VNET_HDR = 15  # frames carry a virtio_net_hdr: GSO frames and partial checksums pass through intact
_PACKET_IGNORE_OUTGOING = 23
_PACKET_OUTGOING = 4
_SO_SNDBUFFORCE, _SO_RCVBUFFORCE = 32, 33


def _packet_socket(ifname: str) -> socket.socket:
    # Protocol 0 until bound, so no frame of another interface is queued before bind().
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
    s.setsockopt(_SOL_PACKET, _PACKET_VNET_HDR, 1)
    try:
        s.setsockopt(_SOL_PACKET, _PACKET_IGNORE_OUTGOING, 1)
    except OSError:  # kernels before 4.20: outgoing frames are filtered below by their packet type
        pass
    s.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, 16 << 20)
    s.setsockopt(socket.SOL_SOCKET, _SO_SNDBUFFORCE, 16 << 20)
    s.bind((ifname, _ETH_P_ALL))
    s.setblocking(False)
    return s


def relay(pairs: list[tuple[str, str, float]]) -> None:
    """Forward frames both ways between each pair of interfaces, each held ``delay`` seconds. Never returns."""
    routes: dict[int, tuple[socket.socket, float, collections.deque]] = {}  # reader fd -> (writer, delay, queue)
    readers, queues = [], []
    for a, b, delay in pairs:
        sa, sb = _packet_socket(a), _packet_socket(b)
        for src, dst in ((sa, sb), (sb, sa)):
            q: collections.deque = collections.deque()  # (due time, frame); FIFO because the delay is constant
            routes[src.fileno()] = (dst, delay, q)
            readers.append(src)
            queues.append((dst, q))
    print("ready", flush=True)
    buf = bytearray(1 << 18)
    view = memoryview(buf)
    while True:
        now = time.monotonic()
        wait = None
        for dst, q in queues:
            while q and q[0][0] <= now:
                try:
                    dst.send(q.popleft()[1])
                except OSError:  # a full shaper queue drops the frame, as a switch port would
                    pass
            if q and (wait is None or q[0][0] - now < wait):
                wait = q[0][0] - now
        ready, _, _ = select.select(readers, [], [], wait)  # select, not epoll: microsecond timeouts
        now = time.monotonic()
        for src in ready:
            _, delay, q = routes[src.fileno()]
            for _ in range(64):
                try:
                    n, addr = src.recvfrom_into(buf)
                except BlockingIOError:
                    break
                if addr[2] != _PACKET_OUTGOING:
                    q.append((now + delay, bytes(view[:n])))


# --------------------------------------------------------------------------------------------
# Measurement: a tiny TCP sender/receiver run inside the namespaces


@attrs.frozen
class PathMeasurement:
    """What one node measured to another over one fabric."""

    src: str
    dst: str
    fabric: Fabric
    connect_s: float = _doc("time of the first TCP connect: ARP plus handshake, about two round trips")
    rtt_s: float = _doc("median round trip of a 1-byte TCP ping-pong")
    bits_per_s: float = _doc("TCP goodput seen by the receiver, first to last byte")


def measure(
    tb: Testbed, src: str, dst: str, fabric: Fabric | str, seconds: float = 1.0, rounds: int = 20
) -> PathMeasurement:
    """RTT and bulk TCP throughput from ``src`` to ``dst``'s address on ``fabric``."""
    fabric = Fabric(fabric)
    addr = tb.address(dst, fabric)
    server = tb.run(
        dst, [sys.executable, THIS_FILE, "probe", "serve", "--bind", addr], stdout=subprocess.PIPE, text=True
    )
    try:
        if server.stdout is None or server.stdout.readline().strip() != "listening":
            raise TestbedError(f"testbed: probe server on {dst} ({addr}) did not start")
        client = tb.run(
            src,
            [
                sys.executable,
                THIS_FILE,
                "probe",
                "client",
                "--to",
                addr,
                "--rounds",
                str(rounds),
                "--seconds",
                str(seconds),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = client.communicate(timeout=30 + seconds + rounds)
        if client.returncode != 0:
            raise TestbedError(f"testbed: probe {src} -> {dst} ({addr}) failed: {err.strip()}")
        result = json.loads(out)
    finally:
        _killpg(server, signal.SIGTERM)
        server.wait()
    return PathMeasurement(src, dst, fabric, result["connect_s"], result["rtt_s"], result["bits_per_s"])


def _probe_serve(bind: str, port: int) -> None:
    with socket.create_server((bind, port)) as srv:
        print("listening", flush=True)
        while True:
            conn, _ = srv.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                mode = conn.recv(1)
                if mode == b"e":  # echo every byte back
                    while data := conn.recv(1):
                        conn.sendall(data)
                elif mode == b"b":  # count bytes until EOF, answer with the goodput
                    total, first, last = 0, None, None
                    while data := conn.recv(1 << 20):
                        last = time.monotonic()
                        first = first or last
                        total += len(data)
                    seconds = (last - first) if first and last and last > first else float("nan")
                    conn.sendall(json.dumps({"bytes": total, "seconds": seconds}).encode())


def _connect(addr: str, port: int, timeout_s: float = 10.0) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((addr, port), timeout=timeout_s)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _probe_client(addr: str, port: int, rounds: int, seconds: float) -> dict[str, float]:
    t0 = time.monotonic()
    with _connect(addr, port) as conn:
        connect_s = time.monotonic() - t0
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(b"e")
        rtts = []
        for _ in range(rounds + 1):  # the first round warms ARP and the path; it is dropped
            t = time.monotonic()
            conn.sendall(b"x")
            if conn.recv(1) != b"x":
                raise OSError("echo server closed the connection")
            rtts.append(time.monotonic() - t)
    with _connect(addr, port) as conn:
        conn.sendall(b"b")
        chunk = b"\0" * (1 << 16)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(chunk)
        conn.shutdown(socket.SHUT_WR)
        reply = json.loads(b"".join(iter(lambda: conn.recv(4096), b"")))
    return {
        "connect_s": connect_s,
        "rtt_s": statistics.median(rtts[1:]),
        "bits_per_s": reply["bytes"] * 8 / reply["seconds"],
    }


# --------------------------------------------------------------------------------------------
# CLI


def _fmt_rate(bits_per_s: float) -> str:
    return f"{bits_per_s / 1e9:.2f} Gbit/s" if bits_per_s >= 1e9 else f"{bits_per_s / 1e6:.1f} Mbit/s"


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _grid_options(f: Any) -> Any:
    for opt in reversed(
        [
            click.option("--domains", default=2, show_default=True, help="number of domains"),
            click.option("--nodes-per-domain", default=2, show_default=True, help="nodes in each domain"),
            click.option("--bandwidth", default="1gbit", show_default=True, help="domain fabric rate (tc units)"),
            click.option("--delay", default="0.2ms", show_default=True, help="domain fabric one-way latency"),
            click.option("--cross-bandwidth", default="100mbit", show_default=True, help="cross-domain fabric rate"),
            click.option("--cross-delay", default="5ms", show_default=True, help="cross-domain fabric one-way latency"),
            click.option(
                "--delay-mode",
                type=click.Choice([m.value for m in DelayMode]),
                default="auto",
                show_default=True,
                help="how delay is made",
            ),
        ]
    ):
        f = opt(f)
    return f


def format_nodes(tb: Testbed) -> str:
    rows = [("node", "namespace", "domain", "dom0", "xdom", "speed")]
    rows += [
        (
            n.name,
            tb.namespace(n.name),
            n.domain,
            tb.address(n.name, Fabric.DOMAIN),
            tb.address(n.name, Fabric.CROSS),
            f"{n.speed:g}",
        )
        for n in tb.spec.nodes
    ]
    return _table(rows)


def format_measurements(tb: Testbed, results: list[PathMeasurement]) -> str:
    """One row per path: what was configured next to what TCP saw."""
    rows = [("path", "fabric", "bandwidth", "delay (one-way)", "RTT floor", "RTT (median)", "TCP goodput")]
    for m in results:
        spec = tb.fabric(m.src, m.fabric)
        label = f"domain {tb.spec.node(m.src).domain}" if m.fabric is Fabric.DOMAIN else "cross-domain"
        measured = (_fmt_ms(m.rtt_s), _fmt_rate(m.bits_per_s))
        rows.append((f"{m.src} -> {m.dst}", label, spec.bandwidth, spec.delay, _fmt_ms(2 * spec.delay_s), *measured))
    return _table(rows)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@click.group()
def main() -> None:
    """Emulated multi-domain cluster on one machine (network namespaces + veth + bridges + tc)."""


@main.command()
def check() -> None:
    """Say whether this host can build a testbed (exit 0) or why not (exit 1)."""
    ok, why = available()
    click.echo(("ok: " if ok else "unavailable: ") + why)
    sys.exit(0 if ok else 1)


@main.command()
@_grid_options
@click.option("--seconds", default=1.0, show_default=True, help="length of each bulk transfer")
def demo(delay_mode: str, seconds: float, **grid: Any) -> None:
    """Build a cluster, measure RTT and TCP goodput inside a domain and across domains, tear down."""
    spec = grid_spec(**grid)
    _exit_if_unavailable()
    with Testbed(spec, delay=delay_mode) as tb:
        click.echo(f"testbed {tb.run_id}: delay by {tb.delay_mode.value}\n{format_nodes(tb)}\n")
        first = spec.nodes[0].name
        same = next((n.name for n in spec.nodes[1:] if n.domain == spec.nodes[0].domain), None)
        other = next((n.name for n in spec.nodes if n.domain != spec.nodes[0].domain), None)
        paths = ([(same, Fabric.DOMAIN)] if same else []) + ([(other, Fabric.CROSS)] if other else [])
        results = []
        for dst, fabric in paths:
            click.echo(f"measuring {first} -> {dst} over {fabric.interface} ...", err=True)
            results.append(measure(tb, first, dst, fabric, seconds=seconds))
        click.echo(format_measurements(tb, results))
    click.echo(f"torn down; namespaces left from {tb.run_id}: {len(list_namespaces(PREFIX + tb.run_id))}")


@main.command()
@_grid_options
def up(delay_mode: str, **grid: Any) -> None:
    """Build a cluster and keep it until Ctrl-C (then tear down); poke at it with `ip netns exec`."""
    spec = grid_spec(**grid)
    _exit_if_unavailable()
    with Testbed(spec, delay=delay_mode) as tb:
        click.echo(f"testbed {tb.run_id}: delay by {tb.delay_mode.value}\n{format_nodes(tb)}")
        click.echo(f"\ne.g. ip netns exec {tb.namespace(spec.nodes[0].name)} python3 ...   (Ctrl-C tears down)")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


@main.command("cleanup")
@click.option(
    "--all", "all_runs", is_flag=True, help=f"remove every '{PREFIX}' namespace (also those of runs still going)"
)
@click.option("--run", "run_id", default=None, help="remove the namespaces of this run id only")
def cleanup_command(all_runs: bool, run_id: str | None) -> None:
    """Remove namespaces (and their links and processes) left by killed runs."""
    if all_runs == (run_id is not None):
        raise click.UsageError("give exactly one of --all or --run RUN_ID")
    removed = cleanup(None if all_runs else run_id)
    click.echo(f"removed {len(removed)} namespace(s)" + (": " + ", ".join(removed) if removed else ""))


@main.command("relay", hidden=True)
@click.option("--pair", "pairs", multiple=True, required=True, help="IF_A,IF_B,DELAY_S")
def relay_command(pairs: tuple[str, ...]) -> None:
    relay([(a, b, float(d)) for a, b, d in (p.split(",") for p in pairs)])


@main.group(hidden=True)
def probe() -> None:
    """The measuring programs run inside the namespaces."""


@probe.command()
@click.option("--bind", required=True)
@click.option("--port", default=PROBE_PORT)
def serve(bind: str, port: int) -> None:
    _probe_serve(bind, port)


@probe.command()
@click.option("--to", "addr", required=True)
@click.option("--port", default=PROBE_PORT)
@click.option("--rounds", default=20)
@click.option("--seconds", default=1.0)
def client(addr: str, port: int, rounds: int, seconds: float) -> None:
    click.echo(json.dumps(_probe_client(addr, port, rounds, seconds)))


def _exit_if_unavailable() -> None:
    ok, why = available()
    if not ok:
        click.echo(f"error: cannot build a testbed here: {why}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    try:
        main()
    except TestbedError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
