"""Host side: ``ip``/``tc`` commands, the namespaces of a run, the host check, tc shaping, the delay relay,
and teardown on every exit path."""

from __future__ import annotations

import atexit
import collections
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.testbed.spec import FabricSpec, TestbedError

if TYPE_CHECKING:
    from bench.testbed.bed import Testbed

PREFIX = "hl_"
ROOT = Path(__file__).resolve().parents[2]  # the repository root: this package's child processes start there


def self_argv(*args: str) -> list[str]:
    """``python -m bench.testbed ARGS``: this package's CLI in a child process (run with cwd = ``ROOT``)."""
    return [sys.executable, "-m", "bench.testbed", *args]


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
