"""Measurement: a tiny TCP sender/receiver run inside the namespaces (RTT and bulk goodput of one path)."""

from __future__ import annotations

import json
import signal
import socket
import statistics
import subprocess
import time

import attrs

from bench.testbed.bed import Testbed
from bench.testbed.netns import ROOT, _killpg, self_argv
from bench.testbed.spec import Fabric, TestbedError, _doc

PROBE_PORT = 5201


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
    server = tb.run(dst, self_argv("probe", "serve", "--bind", addr), stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        if server.stdout is None or server.stdout.readline().strip() != "listening":
            raise TestbedError(f"testbed: probe server on {dst} ({addr}) did not start")
        client = tb.run(
            src,
            self_argv("probe", "client", "--to", addr, "--rounds", str(rounds), "--seconds", str(seconds)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
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
