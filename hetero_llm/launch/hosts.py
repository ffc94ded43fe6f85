"""Which of a cluster's nodes are this machine: every node's host resolved at once, in threads, within one
bounded wait (``RESOLVE_WAIT_S``), so that 128 node hosts cost one lookup's time, not 128 in a row, and a
host that hangs in DNS is named in one line instead of stalling the launch. Torch-free.

A host that does not resolve at all (an unknown name) is simply not this machine, as before: a dry run on a
machine of another cluster is fine. Only a lookup still unanswered when the wait ends is an error.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence

from hetero_llm.errors import LayoutError

RESOLVE_WAIT_S = 10.0  # seconds every node's host together may take to resolve
RESOLVERS = 32  # threads resolving at once (a lookup mostly waits on the network)

Resolve = Callable[[str], list[tuple]]  # host -> socket.getaddrinfo's entries; raises OSError when unknown


def _getaddrinfo(host: str) -> list[tuple]:
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)


def local_addresses() -> set[str]:
    names = {"127.0.0.1", "localhost", "::1", socket.gethostname(), socket.getfqdn()}
    try:
        names |= {str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)}  # IP sockaddrs: a str
    except OSError:
        pass
    return names


def is_local_host(host: str, local: set[str] | None = None, resolve: Resolve | None = None) -> bool:
    """Whether ``host`` names this machine: a name of it (``local``: ``local_addresses()``, when the caller has
    them), or an address a socket can bind here (which also tells apart the hosts of network namespaces that share
    one hostname, as on the testbed)."""
    if host in (local_addresses() if local is None else local):
        return True
    try:
        infos = (resolve or _getaddrinfo)(host)
    except OSError:
        return False
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((addr[0], 0, *addr[2:]))
                return True
        except OSError:
            continue
    return False


def local_hosts(
    hosts: Sequence[str],
    file: str,
    resolve: Resolve | None = None,
    wait_s: float = RESOLVE_WAIT_S,
    local: set[str] | None = None,
) -> list[bool]:
    """For each of ``hosts`` (``cluster.nodes[i].host``, in order): whether it is this machine, every distinct
    host looked up concurrently (``resolve``: ``socket.getaddrinfo``'s entries for a host, or OSError). A lookup unanswered after ``wait_s`` is a ``LayoutError`` naming its node's
    host. The threads are daemons: one stuck in the resolver does not keep the process alive."""
    local = local_addresses() if local is None else local
    todo = [h for h in dict.fromkeys(hosts) if h not in local]
    found: dict[str, bool] = dict.fromkeys(local, True)
    lock, done = threading.Lock(), threading.Event()
    queue = list(reversed(todo))
    if not todo:
        done.set()

    def work() -> None:
        while True:
            with lock:
                if not queue:
                    return
                host = queue.pop()
            answer = is_local_host(host, local, resolve)
            with lock:
                found[host] = answer
                if all(h in found for h in todo):
                    done.set()

    for _ in range(min(RESOLVERS, len(todo))):
        threading.Thread(target=work, name="hl-resolve", daemon=True).start()
    if not done.wait(wait_s):
        with lock:
            late = next(i for i, h in enumerate(hosts) if h not in found)
        raise LayoutError(
            file,
            f"cluster.nodes[{late}].host",
            f"'{hosts[late]}' did not resolve within {wait_s:g} s (check the name and this machine's DNS, or pass "
            "--node NAME or --rank R to say what to start here)",
        )
    with lock:
        return [found[h] for h in hosts]
