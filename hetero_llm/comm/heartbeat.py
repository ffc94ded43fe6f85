"""Name a rank that stops responding (SIGSTOP, a hung host) instead of the ranks left waiting for it.

A rank blocked in a collective or a receive cannot tell a slow peer from a stopped one: its waits last as
long as its peers compute (``hetero_llm.comm.groups.PEER_WAIT``), and a timeout there would fail the
*waiting* ranks, so the launcher would blame them. Liveness is decided here instead: each rank runs a
thread that bumps its own counter in the rendezvous store every ``INTERVAL_S`` and reads everyone
else's. A process that is stopped stops all its threads, so its counter stands still while the rank is
alive to the kernel. When a peer's counter has not moved for ``cluster.timeout_s``, the watcher gives
up for its rank with one line naming that peer, and exits: the main thread may be blocked inside a
collective, where no exception can reach it (an elastic survivor instead hands the line to its round, which cuts
those connections and recovers in place: ``launch/in_place.py``). When the store itself stops answering for that long,
the rank that serves it is the one named (it runs in that rank's process).

A rank that finishes marks itself done, so peers that are still saving or exiting never blame it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from hetero_llm.comm.rendezvous import connect, endpoint
from hetero_llm.errors import LayoutError, RankFailure
from hetero_llm.plan.rank import RankPlan

INTERVAL_S = 1.0
_OP_TIMEOUT_S = 2.0  # one store operation; a stopped server makes every operation wait this long
BEFORE_EXIT: list[Callable[[], None]] = []  # run by exit_now before it ends the process (an elastic run's clean-up)
_DONE = 1 << 40  # added to a rank's counter when it finishes: never blamed after that
_LINGER_S = 3.0  # how long the rank serving the store waits for the others to stop using it


class Heartbeat:
    """Started after the rendezvous, stopped when the rank ends (``with Heartbeat(...):``).

    Two threads: one talks to the store (an operation on a stopped server blocks, however long), the
    other only reads the times the first one recorded, so it notices a store that stopped answering.
    """

    def __init__(self, rp: RankPlan, give_up: Callable[[str, float], None]):
        import torch.distributed as dist

        ep = endpoint(rp)
        rank = rp.rank
        # its own connection (the main thread's store stays free), made within cluster.timeout_s: on a loaded host
        # the server may take longer than one operation's wait to accept it
        try:
            store = connect(rp, ep, time.monotonic() + rp.meeting.timeout_s)
        except LayoutError as e:  # the server rank, stopped since the rendezvous, answers nothing
            raise RankFailure(f"rank {rank}: the heartbeat's store connection: {e.message}") from None
        store.set_timeout(timedelta(seconds=_OP_TIMEOUT_S))
        self.store = dist.PrefixStore(f"{ep.prefix}heartbeat", store)
        self.rp, self.rank, self.server, self.give_up = rp, rank, ep.server, give_up
        self.limit_s = rp.meeting.timeout_s
        now = time.monotonic()
        self._lock = threading.Lock()
        self._answered = now  # when the store last answered
        self._moved = [now] * rp.world_size  # when each rank's counter last changed (or it finished)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._beat, name="hl-heartbeat", daemon=True),
            threading.Thread(target=self._watch, name="hl-watchdog", daemon=True),
        ]

    def __enter__(self) -> Heartbeat:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._stop.set()
        # Say this rank is done, but never wait long on a store that may be gone or stopped. A rank that failed does
        # not linger for the others (a peer may be gone for good: an elastic survivor recovers without that wait).
        failed = exc_type is not None
        done = threading.Thread(target=self._mark_done, args=(failed,), daemon=True)
        done.start()
        done.join(timeout=_OP_TIMEOUT_S if failed else _LINGER_S)

    def _mark_done(self, failed: bool = False) -> None:
        try:
            self.store.add(f"beat/{self.rank}", _DONE)
            if self.rank == self.server and not failed:
                # The store dies with this process: let the other ranks' heartbeats finish first, or one
                # caught in an operation prints torch's connection-closed warning, C++ frames and all.
                deadline = time.monotonic() + _LINGER_S
                keys = [f"beat/{r}" for r in range(self.rp.world_size)]
                while time.monotonic() < deadline and min(int(v) for v in self.store.multi_get(keys)) < _DONE:
                    time.sleep(0.02)
        except Exception:  # the store's rank finished first: nobody is left to blame this one
            pass

    def _beat(self) -> None:
        world = self.rp.world_size
        keys = [f"beat/{r}" for r in range(world)]
        seen = [-1] * world
        created = False
        while not self._stop.wait(INTERVAL_S):
            try:
                self.store.add(keys[self.rank], 1)
                if not created:  # add(key, 0) makes every key, so that multi_get never waits for one
                    created = all(self.store.add(k, 0) >= 0 for k in keys)
                counts = [int(v) for v in self.store.multi_get(keys)]  # two store operations a second per rank
            except Exception:  # no answer in time, or the store is gone: the watchdog sees _answered age
                continue
            now = time.monotonic()
            with self._lock:
                self._answered = now
                for r in range(world):
                    if counts[r] != seen[r] or counts[r] >= _DONE:
                        seen[r], self._moved[r] = counts[r], now

    def _watch(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            now = time.monotonic()
            with self._lock:
                silent = now - self._answered
                stalled = sorted((now - t, r) for r, t in enumerate(self._moved) if r != self.rank)
            if self._stop.is_set():
                return
            if silent > self.limit_s and self.server is not None and self.server != self.rank:
                self._blame(self.server, silent, "the rendezvous store it serves stopped answering")
                return  # give_up ended the process, or handed the failure on (an elastic survivor): once
            if stalled and stalled[-1][0] > self.limit_s:
                self._blame(stalled[-1][1], stalled[-1][0], "no heartbeat")
                return

    def _blame(self, rank: int, seconds: float, why: str) -> None:
        # The other ranks' watchdogs fire within an interval of this one: the rank serving the store
        # lingers so that they give up (and exit) while it still answers them.
        self.give_up(
            f"rank {rank} ({self.rp.peers[rank]}) stopped responding: {why} for {seconds:.0f} s "
            f"(cluster.timeout_s {self.limit_s:g}; a stopped or hung process); rank {self.rank} gave up "
            "waiting for it",
            _LINGER_S if self.rank == self.server else 0.0,
        )


def run_before_exit() -> None:
    """The ``BEFORE_EXIT`` hooks (os._exit skips atexit and finally blocks: what must not be left behind goes now),
    then stdout and stderr flushed."""
    for hook in BEFORE_EXIT:
        try:
            hook()
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()


def exit_now(cause: str, linger_s: float, report: Callable[[str], None]) -> None:
    """Report ``cause`` and end this process (from the heartbeat thread), ``linger_s`` later."""
    report(cause)
    run_before_exit()
    time.sleep(linger_s)
    os._exit(1)
