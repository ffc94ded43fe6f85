"""Where the ranks meet, who serves the store there, and our own arrival check on it.

Every rank looks for the rendezvous at the master node's ``host`` and ``cluster.port`` (``MASTER_ADDR`` /
``MASTER_PORT`` override them). The TCP store is therefore served by a process on the master node: the
lowest rank placed there (the **server rank**), which is rank 0 only when rank 0's device is on the master
node (ranks are numbered by pipeline, stage and device, so often it is not). The server binds the
master's address only, not every interface. Under torchrun the store is torchrun's own (its agent serves
it at the ``MASTER_ADDR`` it gives the workers) and every rank is a client of it.

Every wait is bounded by ``cluster.timeout_s`` and every failure is one line naming the rank and what it
waited for: a rank (and its heartbeat's own connection: ``connect``; an elastic round's: ``reach``) probes the
address with plain sockets until the server answers before it makes a store client, so a master that never
appears, an unresolvable host or an address that does not answer ends in our message, not in torch's retry
warnings and C++ frames. What answers must then answer a
store's ping (``_check_is_store``): torch's store client waits for that reply without any timeout, so a
foreign server on the port (which accepts and says nothing, or says something else) would hold the rank
forever. A server rank whose port is taken is refused before any rank starts (``check_port_free``).

Neither the store nor gloo authenticate anything: whoever reaches the port can join or read the
rendezvous. Run on a trusted network (docs/launch.md).

Torch-free until a store is made: the CLI checks the address and the port before any rank starts.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

import attrs

from hetero_llm.errors import LayoutError, RankFailure

if TYPE_CHECKING:
    from hetero_llm.plan import Plan
    from hetero_llm.plan.rank import Meeting, RankPlan

_PROBE_S = 2.0  # longest single connect attempt while waiting for the server
# torch's TCPStore wire protocol (c10d/TCPStoreBackend.hpp, the same for its libuv and its classic server): a
# client opens with VALIDATE and the magic number, then PING with a nonce that the server sends back. Host
# byte order. tests/integration/test_failures_named.py checks a real store still answers it.
_VALIDATE, _PING, _MAGIC = 0, 13, 0x3C85F7CE


@attrs.frozen
class Endpoint:
    """The rendezvous as every rank of one run sees it."""

    host: str
    port: int
    server: int | None  # the rank serving the store; None: a store served by someone else (torchrun's agent)
    prefix: str = ""  # key prefix: torchrun restarts a group on the same store, each attempt gets its own keys
    where: str = ""  # what the host and port came from, for messages

    @property
    def coordinator(self) -> int:
        """The rank that checks arrivals and plans: the server, else rank 0."""
        return 0 if self.server is None else self.server


def server_rank(plan: Plan | RankPlan) -> int:
    """The lowest rank on the master node: it serves the store at the master's host."""
    meeting: Meeting = plan.meeting
    if meeting.server is None:
        path = "cluster.master" if meeting.declared else "cluster.nodes[0]"
        raise LayoutError(
            meeting.file,
            path,
            f"the master node '{meeting.master}' runs no rank, so nothing would "
            "serve the rendezvous at its host; make a node with ranks the master (cluster.master)",
        )
    return meeting.server


def endpoint(plan: Plan | RankPlan, environ: Mapping[str, str] | None = None) -> Endpoint:
    """The rendezvous address, port and server of this run (checked: a bad MASTER_PORT is a LayoutError)."""
    env = os.environ if environ is None else environ
    meeting: Meeting = plan.meeting
    host = env.get("MASTER_ADDR") or meeting.host
    text = env.get("MASTER_PORT") or ""
    if text:
        if not (text.strip().isdigit() and 1 <= int(text) <= 65535):
            raise LayoutError(
                "environment",
                "MASTER_PORT",
                f"'{text}' is not a TCP port (1..65535); set one, or unset it to use cluster.port ({meeting.port})",
            )
        port = int(text)
    else:
        port = meeting.port
    where = ("MASTER_ADDR" if env.get("MASTER_ADDR") else f"node {meeting.master}'s host") + (
        ", MASTER_PORT" if text else ", cluster.port"
    )
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent serves the store; attempts share it
        return Endpoint(host, port, None, f"attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/", where)
    if env.get("TORCHELASTIC_RUN_ID"):  # torchrun without a shared store: rank 0 serves at MASTER_ADDR (torch's rule)
        return Endpoint(host, port, 0, "", where)
    return Endpoint(host, port, server_rank(plan), "", where)


def describe(plan: Plan) -> str:
    """The ``--dry-run`` line: where the ranks meet and who serves the store there."""
    ep = endpoint(plan)
    if ep.server is None:
        return f"rendezvous: {ep.host}:{ep.port} ({ep.where}), torchrun's store"
    info = plan.ranks[ep.server]
    return f"rendezvous: {ep.host}:{ep.port} ({ep.where}), served by rank {ep.server} ({info.device_id})"


def rendezvous(rp: RankPlan, agree: str = ""):
    """Meet every other rank; return the store (a ``PrefixStore`` per torchrun attempt).

    Each rank arrives with the fingerprint of the plan it compiled plus ``agree`` (e.g. the save it resumes
    from): the coordinator names a rank that differs, or one that never arrived, before anything trains.
    """
    import torch.distributed as dist

    ep = endpoint(rp)
    rank, timeout = rp.rank, rp.meeting.timeout_s
    start = time.monotonic()
    store = _serve(rp, ep, timeout) if rank == ep.server else connect(rp, ep, start + timeout)
    if ep.prefix:
        store = dist.PrefixStore(ep.prefix, store)
    _check_arrivals(rp, ep, store, f"{rp.fingerprint}{'|' + agree if agree else ''}", timeout)
    return store


def connect(rp: RankPlan, ep: Endpoint, deadline: float):
    """A store client of the rendezvous at ``ep``, connected by ``deadline`` (``time.monotonic()``): plain sockets
    retry until the server accepts and answers a store's ping, then torch's client connects, waiting until the
    deadline too (a loaded host may take seconds to accept). A failure is one line, without torch's C++ dump."""
    import torch.distributed as dist

    _check_is_store(rp, ep, _wait_for_server(rp, ep, deadline), deadline)
    try:
        return dist.TCPStore(
            ep.host,
            ep.port,
            rp.world_size,
            False,
            timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())),
            wait_for_workers=False,
        )
    except (RuntimeError, TimeoutError, ValueError) as e:
        raise RankFailure(
            f"rank {rp.rank} reached {ep.host}:{ep.port} but its store did not answer: {_first_line(e)}"
        ) from None


def _serve(rp: RankPlan, ep: Endpoint, timeout: float):
    """The server rank: listen on the master's address only, and serve the store from that socket."""
    import torch.distributed as dist

    sock = listen(ep.host, ep.port, f"rank {ep.server}")
    try:
        store = dist.TCPStore(
            ep.host,
            ep.port,
            rp.world_size,
            True,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except (RuntimeError, TimeoutError, ValueError) as e:
        sock.close()
        raise RankFailure(
            f"rank {ep.server} could not serve the rendezvous on {ep.host}:{ep.port}: {_first_line(e)}"
        ) from None
    sock.detach()  # the store serves from this descriptor now: closing it here would stop the server
    return store


def listen(host: str, port: int, who: str) -> socket.socket:
    """A listening TCP socket on ``host``'s address (not every interface); one-line errors.

    When ``host`` is not an address of this machine (``MASTER_ADDR`` as other nodes see the master
    through NAT or a port forward), it listens on every interface instead and says so on stderr.
    """

    def everywhere() -> None:
        sys.stderr.write(
            f"warning: {who}: {host} is not an address of this machine; serving the rendezvous "
            f"on every interface, port {port}\n"
        )

    try:
        sock = _bind(host, port, everywhere)
    except socket.gaierror as e:
        raise RankFailure(
            f"{who} cannot serve the rendezvous: host '{host}' does not resolve ({e.strerror}); "
            "fix the master node's host or MASTER_ADDR"
        ) from None
    except OSError as e:
        raise RankFailure(f"{who} could not serve the rendezvous on {host}:{port}: {_why(e)}") from None
    try:
        sock.listen(512)
    except OSError as e:
        sock.close()
        raise RankFailure(f"{who} could not serve the rendezvous on {host}:{port}: {_why(e)}") from None
    return sock


def _why(e: OSError) -> str:
    hint = " (port in use: set MASTER_PORT or cluster.port)" if e.errno == errno.EADDRINUSE else ""
    return f"{e.strerror}{hint}"


def check_port_free(plan: Plan, ranks: list[int]) -> None:
    """Before ``ranks`` start on this host: when one of them serves the store, its port must be free here
    (a ``LayoutError`` naming the port otherwise, rather than one rank's failure after every rank started)."""
    ep = endpoint(plan)
    if ep.server is None or ep.server not in ranks:
        return
    try:
        _bind(ep.host, ep.port).close()
    except OSError as e:  # anything else (an unresolvable host, no permission) is the server rank's to name
        if e.errno == errno.EADDRINUSE:
            file, key = _port_key(plan.meeting.file, ep)
            raise LayoutError(
                file,
                key,
                f"port {ep.port} on {ep.host} is in use by another program, so rank {ep.server} cannot serve "
                f"the rendezvous there (stop it, or choose another {key})",
            ) from None


def _port_key(file: str, ep: Endpoint) -> tuple[str, str]:
    """Where the port came from, for a message: (file, key)."""
    return ("environment", "MASTER_PORT") if "MASTER_PORT" in ep.where else (file, "cluster.port")


def _bind(host: str, port: int, everywhere: Callable[[], None] = lambda: None) -> socket.socket:
    """A socket bound to ``port`` on ``host``'s address, or, when that is not an address of this machine, on
    every interface (after calling ``everywhere``); OSError and socket.gaierror as they come."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL:
                raise
            everywhere()
            sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    except BaseException:
        sock.close()
        raise
    return sock


def _check_is_store(rp: RankPlan, ep: Endpoint, sock: socket.socket, deadline: float) -> None:
    """What accepted ``sock`` answers a store's ping by ``deadline`` (at least a second from now), or a
    ``LayoutError`` naming the port. A server rank that has bound its port but not made its store yet answers
    once it has: the ping waits in the socket until then."""
    answered = ping(sock, deadline)
    if answered:
        return
    file, key = _port_key(rp.meeting.file, ep)
    if answered is None:
        what = (
            f"accepted a connection but gave no rendezvous answer within {rp.meeting.timeout_s:g} s: something "
            "that is not hetero-launch's rendezvous listens there, or the process serving it is stopped"
        )
    else:
        what = "is answered by something that is not hetero-launch's rendezvous"
    raise LayoutError(file, key, f"port {ep.port} on {ep.host} {what} (stop it, or choose another {key})")


def ping(sock: socket.socket, deadline: float) -> bool | None:
    """Ping a store through connected ``sock`` (closed after): True if it answers as one by ``deadline`` (at least
    a second from now); False if something else was said, or the connection was closed or reset; None if
    nothing was said by then."""
    nonce = os.getpid() & 0xFFFFFFFF
    reply = b""
    with sock:
        try:
            sock.sendall(struct.pack("=BIBI", _VALIDATE, _MAGIC, _PING, nonce))
            while len(reply) < 4:
                sock.settimeout(max(1.0, deadline - time.monotonic()))
                chunk = sock.recv(4 - len(reply))
                if not chunk:
                    return False  # closed: a store keeps a client's connection open
                reply += chunk
        except TimeoutError:
            return None if not reply else False
        except OSError:  # reset: not a store either
            return False
    return reply == struct.pack("=I", nonce)


def _wait_for_server(rp: RankPlan, ep: Endpoint, deadline: float) -> socket.socket:
    """Connect plain sockets to the rendezvous until one is accepted, at most until ``deadline``; the
    connected socket."""
    rank = rp.rank
    try:
        reached = reach(ep.host, ep.port, deadline)
    except socket.gaierror as e:
        raise RankFailure(
            f"rank {rank}: the rendezvous host '{ep.host}' ({ep.where}) does not resolve ({e.strerror}); fix it"
        ) from None
    if isinstance(reached, socket.socket):
        return reached
    who = "torchrun's store" if ep.server is None else f"rank {ep.server} ({rp.peers[ep.server]}), which serves it,"
    raise RankFailure(
        f"rank {rank}: nothing answered at {ep.host}:{ep.port} ({ep.where}) within {rp.meeting.timeout_s:g} s "
        f"(last: {reached}); is {who} started, and is the address right?"
    )


def reach(host: str, port: int, deadline: float) -> socket.socket | str:
    """A plain socket connected to ``host:port``, retried until ``deadline`` (``time.monotonic()``); else the last
    connection error, in words. ``socket.gaierror`` when the host does not resolve."""
    while True:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        left = deadline - time.monotonic()
        try:
            return socket.create_connection((host, port), timeout=max(0.05, min(_PROBE_S, left)))
        except OSError as e:
            why = e.strerror or str(e) or type(e).__name__
        if time.monotonic() >= deadline:
            return why
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def server_gone(rp: RankPlan) -> RankFailure | None:
    """After this rank failed: when another rank serves the store and its port refuses connections, or closes
    them unanswered, one line naming that rank as gone (its death broke this rank's connections). None while the
    store answers, and while it is silent: a stopped server, which the heartbeat names (comm/heartbeat.py)."""
    ep = endpoint(rp)
    if ep.server is None or ep.server == rp.rank:
        return None
    limit = min(_PROBE_S, rp.meeting.timeout_s)
    try:
        sock = socket.create_connection((ep.host, ep.port), timeout=limit)
    except OSError:  # refused: its process is gone; or its host is
        pass
    else:  # a process still dying may hold its listening socket a moment longer, and then reset what it took
        if ping(sock, time.monotonic() + limit) is not False:
            return None
    return RankFailure(
        f"rank {rp.rank}: rank {ep.server} ({rp.peers[ep.server]}), which served the rendezvous store at "
        f"{ep.host}:{ep.port}, is gone: no connection to it is answered any more (its process died or was "
        "killed, or its host is unreachable; see its node's output)"
    )


def _check_arrivals(rp: RankPlan, ep: Endpoint, store, token: str, timeout: float) -> None:
    rank = rp.rank
    store.set(f"arrived/{rank}", token)
    world = rp.world_size
    coordinator = ep.coordinator
    if rank == coordinator:
        deadline = time.monotonic() + timeout
        missing = list(range(world))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"arrived/{r}"])]
            if missing:
                time.sleep(0.05)
        if missing:
            names = ", ".join(f"rank {r} ({rp.peers[r]})" for r in missing)
            _abort(store, "abort", world - len(missing) - 1)
            raise RankFailure(f"rendezvous timed out after {timeout:g} s: never arrived: {names}")
        tokens = {r: store.get(f"arrived/{r}").decode() for r in range(world)}
        differ = [r for r in range(world) if tokens[r] != token]
        if differ:
            names = ", ".join(f"rank {r} ({rp.peers[r]}): {tokens[r]}" for r in differ)
            _abort(store, "mismatch", world - 1)
            raise RankFailure(
                f"ranks compiled different plans: rank {rank}: {token}; {names} "
                "(start every rank with the same layout, the same --set overrides and the same --resume)"
            )
        store.set("go", "ok")
        return
    try:
        # The coordinator decides within ``timeout`` of its own start, which came before this rank reached it.
        store.wait(["go"], timedelta(seconds=timeout + 5))
        go = store.get("go")
        if go != b"ok":
            store.add("go_seen", 1)  # the coordinator keeps the store up until every rank has read why
    except Exception:  # a timeout, or the coordinator gave up and closed the store: both end the rendezvous
        raise RankFailure(
            f"rank {rank}: rendezvous did not complete within {timeout:g} s "
            f"(rank {coordinator} names the ranks that never arrived)"
        ) from None
    if go == b"mismatch":
        raise RankFailure(
            f"rank {rank}: rank {coordinator} found ranks with a different plan (this rank's: {token}); "
            "start every rank with the same layout, the same --set overrides and the same --resume"
        )
    if go != b"ok":
        raise RankFailure(f"rank {rank}: rendezvous aborted by rank {coordinator} (another rank never arrived)")


def _abort(store, why: str, readers: int, grace_s: float = 5.0) -> None:
    """Tell the other ranks why the rendezvous failed, and serve the store until ``readers`` of them
    have read it (at most ``grace_s``): the server's store dies with its process, and a rank that finds
    it gone can only report a timeout instead of the cause."""
    store.set("go", why)
    deadline = time.monotonic() + grace_s
    while readers > 0 and store.add("go_seen", 0) < readers and time.monotonic() < deadline:
        time.sleep(0.02)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
