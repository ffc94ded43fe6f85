"""The ``Testbed``: names and addresses of the emulated nodes, processes on them, build and teardown."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import time
from typing import Any

from bench.testbed.netns import (
    _SIGNALS,
    PREFIX,
    ROOT,
    _delete_namespaces,
    _killpg,
    _probe_host,
    _register,
    _sh,
    _shape,
    _unregister,
    list_namespaces,
    self_argv,
)
from bench.testbed.spec import DelayMode, Fabric, FabricSpec, TestbedError, TestbedSpec

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
            raise TestbedError(
                "testbed: delay 'none' asked for, but a fabric declares a delay (set it to '0ms', or use 'auto')"
            )
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
        argv = self_argv("relay", *[a for p in pairs for a in ("--pair", p)])
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.switch_namespace, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd=ROOT,
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
