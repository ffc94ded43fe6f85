"""In-place recovery of an elastic round: when a node is lost, the survivors keep their processes.

A round (``launch/elastic.py``) runs in *generations*. Generation 0 is the round torchrun started. When a layout
rank's training fails (a peer's connection closed: a node was killed) or its heartbeat gives up on a peer that
stopped responding (a hung node: ``comm/heartbeat.py``), its worker does not exit: it opens the next
generation in the round's store (served by torchrun's rank 0, which must be a survivor), and every other worker
of the round joins it as its own training fails or, idle or finished, as it sees the generation open. Torchrun
rank 0, the **leader**, decides who is in it: every worker that arrived, once each worker of the generation has
either arrived or been silent for ``LOST_S`` (its ``Liveness`` beat, a thread of every worker, stopped: its
process is gone or stopped), whole nodes only. A node with a silent worker is left out with all its workers; a
worker left out (it arrived late, or its node lost a worker) ends as before and its agent restarts the round.
The members then plan for their nodes, compare fingerprints and resume exactly as a new round does (the save or
the newest snapshot step the nodes present hold in memory, the lost node's blocks from their peer replicas), in the
same processes, over the same store, each generation under its own keys (``g<N>/``).

A worker may be blocked in its generation's communication with a peer that is alive but itself waiting (a killed
node's connections close, but only its neighbours see it; gloo's ``abort`` does not end an operation in flight). So
as soon as a worker sees the next generation open, its ``Liveness`` thread cuts its process's connections of the
old generation (``cut_connections``: every TCP socket except the round store's): whatever it was blocked in fails at
once, and so do its peers' operations with it, and every survivor arrives within a beat or two.

Only torchrun's agents can bring a node *in*: a returning node waits at torchrun's rendezvous, and the agents
restart every worker for the round that takes it in. A recovery that cannot be made in place (the store's process
is on the lost node, no worker was lost, the survivors cannot agree within ``cluster.timeout_s``) raises the
failure that started it, and the round restarts as before, saying why.

Torch-free except for the store client a ``Liveness`` makes.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import attrs

from hetero_llm.errors import RankFailure

BEAT_S = 0.2  # how often each worker's Liveness beats
LOST_S = 1.5  # a worker whose beat has not moved for this long, and that has not arrived, is lost
POLL_S = 0.05


@attrs.frozen
class Generation:
    """The workers of one generation of a round: their torchrun ranks (``ranks[i]`` is its rank ``i``) and their
    (node, local rank)."""

    number: int
    ranks: tuple[int, ...]
    members: tuple[tuple[str, int], ...]

    @staticmethod
    def first(members: Sequence[tuple[str, int]]) -> Generation:
        return Generation(0, tuple(range(len(members))), tuple((str(n), int(i)) for n, i in members))

    def rank_of(self, torchrun_rank: int) -> int:
        return self.ranks.index(torchrun_rank)

    @property
    def prefix(self) -> str:
        return f"g{self.number}/"

    def nodes(self) -> list[str]:
        return list(dict.fromkeys(n for n, _ in self.members))


def opened(store, gen: Generation) -> bool:
    """Whether a worker has opened the generation after ``gen`` (its training failed): the others join it."""
    return store.check([f"g{gen.number + 1}/open"])


def open_next(store, gen: Generation, worker_rank: int, why: str) -> None:
    """This worker enters the next generation (``why``: its failure, kept by the leader for its line; the first
    one kept: a heartbeat's line naming a hung peer comes before the connection errors its cut causes)."""
    nxt = f"g{gen.number + 1}/"
    if store.check([f"{nxt}here/{worker_rank}"]):  # entered already (its heartbeat's line, then its rank's failure)
        return
    store.set(f"{nxt}why/{worker_rank}", why)
    store.set(f"{nxt}open", "1")
    store.set(f"{nxt}here/{worker_rank}", "1")
    store.add(f"{nxt}arrived", 1)  # after its key: the leader reads who is here when this moves (a race counts twice)


@attrs.frozen
class Decision:
    """What the leader decided for a generation: its workers, the nodes lost, and why (the first failure)."""

    ranks: tuple[int, ...]
    lost: tuple[str, ...]
    why: str

    def to_json(self) -> str:
        return json.dumps([list(self.ranks), list(self.lost), self.why])

    @staticmethod
    def from_json(text: str | bytes) -> Decision:
        ranks, lost, why = json.loads(text)
        return Decision(tuple(ranks), tuple(lost), why)


def decide(
    gen: Generation, arrived: set[int], silent: set[int], whys: dict[int, str], deadline_passed: bool
) -> Decision | None:
    """The leader's rule, pure: None while a worker of ``gen`` has neither arrived nor been ``silent`` (and the
    deadline has not passed); else the arrived workers of the nodes none of whose workers is missing."""
    missing = [r for r in gen.ranks if r not in arrived]
    if any(r not in silent for r in missing) and not deadline_passed:
        return None
    lost_nodes = {gen.members[gen.rank_of(r)][0] for r in missing}
    ranks = tuple(r for r in gen.ranks if r in arrived and gen.members[gen.rank_of(r)][0] not in lost_nodes)
    first = next((whys[r] for r in sorted(whys)), "")
    return Decision(ranks, tuple(n for n in gen.nodes() if n in lost_nodes), first)


def agree(store, gen: Generation, worker_rank: int, liveness: Liveness, timeout_s: float) -> Decision:
    """The next generation's members, as the leader (torchrun rank 0) decides them; every worker of ``gen`` that
    arrives calls this after ``open_next``. The leader waits at most ``timeout_s`` for the others."""
    nxt = f"g{gen.number + 1}/"
    if worker_rank == gen.ranks[0]:
        deadline = time.monotonic() + timeout_s
        counted, arrived = -1, set()
        while True:  # one store operation a poll; the workers' keys are read again only when one more arrived
            if (count := int(store.add(f"{nxt}arrived", 0))) != counted:
                counted = count
                arrived |= {r for r in gen.ranks if r not in arrived and store.check([f"{nxt}here/{r}"])}
            silent = liveness.silent(gen.ranks, LOST_S)
            decision = decide(gen, arrived, silent, {}, time.monotonic() > deadline)
            if decision is not None:  # each arrived worker set its why before its arrival (open_next)
                why = next((store.get(f"{nxt}why/{r}").decode() for r in sorted(arrived)), "")
                decision = attrs.evolve(decision, why=why)
                store.set(f"{nxt}decision", decision.to_json())
                return decision
            time.sleep(POLL_S)
    return Decision.from_json(store.get(f"{nxt}decision"))  # the store's timeout bounds the wait


def next_generation(gen: Generation, decision: Decision) -> Generation:
    return Generation(gen.number + 1, decision.ranks, tuple(gen.members[gen.rank_of(r)] for r in decision.ranks))


def recover(
    store, worker_rank: int, gen: Generation, liveness: Liveness, failure: RankFailure, timeout_s: float
) -> tuple[Generation, str]:
    """The next generation, agreed in place after ``failure`` (above), and the words its round
    line adds; ``failure`` raised, with why, when the survivors cannot go on in place (the round then restarts)."""
    t0 = time.perf_counter()
    try:
        open_next(store, gen, worker_rank, str(failure))
        liveness.cut(gen.number + 1)  # what this process's peers are blocked in with it fails at once
        decision = agree(store, gen, worker_rank, liveness, timeout_s)
    except Exception as e:  # torchrun rank 0's process, which serves the store, is gone (its node was lost)
        why = f"this round's store (torchrun's rank 0, node {gen.members[0][0]}) is gone: {type(e).__name__}"
        raise RankFailure(f"{failure}; not recovered in place ({why})") from None
    if not decision.lost:
        raise RankFailure(f"{failure}; not recovered in place (no node was lost)") from None
    if worker_rank not in decision.ranks:
        raise RankFailure(
            f"{failure}; this worker's node was left out of the survivors' generation {gen.number + 1} "
            f"(nodes lost: {', '.join(decision.lost)}): its agent restarts it"
        ) from None
    nxt = next_generation(gen, decision)
    if worker_rank == gen.ranks[0]:
        sys.stderr.write(
            f"elastic: node(s) {', '.join(decision.lost)} lost ({decision.why or failure}); the survivors "
            f"({', '.join(nxt.nodes())}) re-plan in place\n"
        )
    agreed_s = time.perf_counter() - t0
    return nxt, f", in place: {', '.join(decision.lost)} lost, survivors agreed in {agreed_s:.2f} s"


def leave(store, worker_rank: int, gen: Generation, timeout_s: float) -> None:
    """The end of a generation after the first, whose ranks met in the round's store (their heartbeats too):
    torchrun rank 0, whose process serves it, returns once every worker has stopped using it, or after
    ``timeout_s``."""
    try:
        store.add(f"{gen.prefix}left", 1)
        if worker_rank != gen.ranks[0]:
            return
        deadline = time.monotonic() + timeout_s
        while store.add(f"{gen.prefix}left", 0) < len(gen.ranks) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    except Exception:  # the store's process ended: the run is over either way
        return


def _socket_inodes() -> dict[int, int]:
    """This process's sockets: inode -> file descriptor."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(fd)
    return found


LISTEN = "0A"  # a socket's state in /proc/net/tcp


def tcp_sockets() -> Iterator[tuple[int, str, int, int]]:
    """Every TCP socket of this network namespace (/proc/self/net/tcp and tcp6, read: nothing connects): (inode,
    state, local port, remote port)."""
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            local, remote = int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16)
            yield int(cols[9]), cols[3], local, remote


def _tcp_ports() -> dict[int, tuple[int, int]]:
    """Every connected TCP socket of this network namespace (not a listener: one shut down ends gloo's accept
    thread, and the process with it): inode -> (local port, remote port)."""
    return {inode: (local, remote) for inode, state, local, remote in tcp_sockets() if state != LISTEN}


def cut_connections(keep_port: int) -> int:
    """Shut down every TCP socket of this process that is not a connection to or from port ``keep_port`` (the
    round's store): the previous generation's gloo pairs, its rendezvous store, its heartbeat's. An operation
    blocked on one fails at once (``Connection closed``), here and at the peer. Returns how many were cut."""
    cut = 0
    ports = _tcp_ports()
    for inode, fd in _socket_inodes().items():
        if inode not in ports or keep_port in ports[inode]:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            pass
        finally:
            sock.close()  # the duplicate only: the descriptor its owner holds stays (shut down)
    return cut


class Liveness:
    """A daemon thread that bumps ``alive/<rank>`` in the round's store every ``BEAT_S`` over its own connection,
    and, in the leader, reads everyone's: when each worker's counter last moved (``silent``). A killed or stopped
    process stops beating; a worker busy training does not (the thread runs beside its steps). When it sees the
    generation after ``generation`` open, it cuts this process's other connections (``cut_connections``)."""

    generation = 0  # the generation this worker runs (elastic.run sets it)

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, lead: bool):
        from datetime import timedelta

        import torch.distributed as dist

        self.store = dist.TCPStore(
            host, port, world_size, False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self.store.set_timeout(timedelta(seconds=2.0))
        self.rank, self.world_size, self.lead, self.port = rank, world_size, lead, port
        self._cut = -1  # the last generation whose connections were cut
        self._cut_lock = threading.Lock()
        now = time.monotonic()
        self._moved = [now] * world_size
        self._seen = [-1] * world_size
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hl-liveness", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        keys = [f"alive/{r}" for r in range(self.world_size)]
        while not self._stop.wait(BEAT_S):
            try:
                self.store.add(keys[self.rank], 1)
                nxt = self.generation + 1
                if self._cut < nxt and self.store.check([f"g{nxt}/open"]):
                    self.cut(nxt)
                if not self.lead:
                    continue
                counts = [int(self.store.add(k, 0)) for k in keys]  # add(k, 0): no wait for a key never set
            except Exception:  # the store is gone or late: the round fails or recovers without this beat
                continue
            now = time.monotonic()
            with self._lock:
                for r, c in enumerate(counts):
                    if c != self._seen[r]:
                        self._seen[r], self._moved[r] = c, now

    def cut(self, generation: int) -> None:
        """Cut this process's connections of the generations before ``generation``, once (the main thread calls it
        as it enters ``generation``, before it makes that generation's connections; the thread when it sees it open)."""
        with self._cut_lock:
            if self._cut < generation:
                self._cut = generation
                cut_connections(self.port)

    def silent(self, ranks: Sequence[int], for_s: float) -> set[int]:
        """The workers of ``ranks`` whose beat has not moved for ``for_s`` seconds (the leader's view)."""
        now = time.monotonic()
        with self._lock:
            return {r for r in ranks if now - self._moved[r] > for_s}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * BEAT_S + 2.0)  # at most one store operation (2 s) in flight
