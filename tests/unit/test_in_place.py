"""In-place recovery's pure parts (hetero_llm/launch/in_place.py): the leader's rule for the next generation's
members, and cutting a process's connections except the round store's. The recovery itself, in real torchrun
agents, is tests/integration/test_elastic_in_place.py."""

from __future__ import annotations

import threading

import pytest

from hetero_llm.launch import in_place
from hetero_llm.launch.in_place import Decision, Generation

# torchrun ranks 0..3: n0 runs two workers, n1 and n2 one each
GEN = Generation.first([("n0", 0), ("n0", 1), ("n1", 0), ("n2", 0)])


def test_the_leader_waits_while_a_worker_has_neither_arrived_nor_gone_silent():
    assert in_place.decide(GEN, {0, 1, 2}, set(), {}, False) is None  # rank 3 may still be busy training
    assert in_place.decide(GEN, {0, 1}, {3}, {}, False) is None  # rank 2 is alive, not yet arrived


def test_a_silent_workers_node_is_lost_and_the_others_go_on_in_order():
    got = in_place.decide(GEN, {0, 1, 2}, {3}, {2: "rank 2 failed: closed"}, False)
    assert got == Decision((0, 1, 2), ("n2",), "rank 2 failed: closed")
    nxt = in_place.next_generation(GEN, got)
    assert nxt == Generation(1, (0, 1, 2), (("n0", 0), ("n0", 1), ("n1", 0)))
    assert nxt.rank_of(2) == 2 and nxt.prefix == "g1/" and nxt.nodes() == ["n0", "n1"]


def test_a_node_that_lost_one_of_its_workers_is_left_out_whole():
    got = in_place.decide(GEN, {0, 2, 3}, {1}, {}, False)  # n0:1 silent: n0:0 is left out with it
    assert got is not None and got.ranks == (2, 3) and got.lost == ("n0",)


def test_no_worker_lost_is_a_decision_with_nothing_lost_which_the_worker_does_not_recover_from():
    got = in_place.decide(GEN, {0, 1, 2, 3}, set(), {}, False)
    assert got is not None and got.lost == () and got.ranks == (0, 1, 2, 3)


def test_past_the_deadline_every_worker_that_did_not_arrive_is_lost():
    got = in_place.decide(GEN, {0, 1}, set(), {}, True)
    assert got is not None and got.ranks == (0, 1) and got.lost == ("n1", "n2")


def test_a_decision_survives_its_text():
    d = Decision((0, 2), ("n1",), "why")
    assert Decision.from_json(d.to_json()) == d


def test_the_first_failure_by_rank_is_the_why():
    got = in_place.decide(GEN, {0, 1, 2}, {3}, {2: "second", 0: "first"}, False)
    assert got is not None and got.why == "first"


_CUT = """
import socket, threading
from hetero_llm.launch import in_place

def pair():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return server, client, accepted

store_server, store_client, store_accepted = pair()  # the round store: kept, both ends
other_server, other_client, other_accepted = pair()  # a gloo pair of the old generation: cut
got = []
blocked = threading.Thread(target=lambda: got.append(other_client.recv(1)), daemon=True)
blocked.start()
cut = in_place.cut_connections(store_server.getsockname()[1])
blocked.join(timeout=30)
assert not blocked.is_alive() and got == [b""], got  # the receive ended (no bytes: shut down)
assert cut == 2, cut  # both ends of the other pair, and nothing else: this process has no other connection
store_client.sendall(b"x")
assert store_accepted.recv(1) == b"x"  # the store's connection still carries
for listener in (store_server, other_server):  # listeners are not cut (gloo's accept thread would die)
    socket.create_connection(listener.getsockname()).close()
print("ok")
"""


def test_cutting_connections_ends_a_blocked_receive_and_keeps_the_stores_and_every_listener():
    """In a process of its own: the cut is of every connection of the process (this test's would be cut too)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CUT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("lead", [True, False])
def test_liveness_beats_and_the_leader_sees_who_went_silent(lead):
    from datetime import timedelta

    import torch.distributed as dist

    from harness import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    live = in_place.Liveness("127.0.0.1", port, 0, 2, 30, lead)
    try:
        server.add("alive/1", 1)  # rank 1 beat once, then never again
        while int(server.add("alive/0", 0)) < 3:  # this worker's thread beats
            pass
        if lead:
            waited = 0.0
            while 1 not in live.silent([0, 1], 0.5) and waited < 30:
                threading.Event().wait(0.05)
                waited += 0.05
            assert live.silent([0, 1], 0.5) == {1}  # rank 0 beats on, rank 1 went silent
    finally:
        live.stop()
        del server


def test_a_workers_first_why_is_kept_when_it_enters_the_next_generation_again():
    """A hung peer: the heartbeat's line opens the next generation; the connection errors its cut causes, which the
    same worker's rank then fails with, do not replace it (the leader's line names the hung node, not the cut)."""
    import torch.distributed as dist

    store = dist.HashStore()
    in_place.open_next(store, GEN, 2, "rank 3 (n2:0) stopped responding: no heartbeat for 10 s")
    assert in_place.opened(store, GEN)
    in_place.open_next(store, GEN, 2, "rank 2 (n1:0) failed: Connection closed by peer")
    in_place.open_next(store, GEN, 0, "rank 0 (n0:0) failed: Connection closed by peer")
    assert store.get("g1/why/2").decode() == "rank 3 (n2:0) stopped responding: no heartbeat for 10 s"
    assert store.get("g1/why/0").decode() == "rank 0 (n0:0) failed: Connection closed by peer"
    assert store.check(["g1/here/0", "g1/here/2"]) and not store.check(["g1/here/1"])


def test_an_elastic_ranks_heartbeat_hands_a_hung_peer_to_its_round_instead_of_exiting(monkeypatch, capsys):
    from hetero_llm.comm import heartbeat
    from hetero_llm.train import rank as rank_mod
    from hetero_llm.train.options import RunOptions

    exits, handed = [], []
    monkeypatch.setattr(heartbeat, "exit_now", lambda cause, linger_s, report: exits.append(cause))
    rank_mod._give_up(1, RunOptions())("rank 3 (n2:0) stopped responding", 0.0)
    assert exits == ["rank 3 (n2:0) stopped responding"] and handed == []  # a plain rank ends its process
    rank_mod._give_up(1, RunOptions(on_lost_peer=handed.append))("rank 3 (n2:0) stopped responding", 0.0)
    assert handed == ["rank 3 (n2:0) stopped responding"] and len(exits) == 1  # an elastic one hands it on
    assert "rank 3 (n2:0) stopped responding; the survivors recover in place" in capsys.readouterr().err


def test_the_heartbeats_watchdog_gives_up_once_and_stops_watching(monkeypatch):
    """After ``give_up`` returns (an elastic survivor's: the round recovers in place), the watchdog does not blame
    the silent peer again every interval."""
    import time as time_mod

    from hetero_llm.comm import heartbeat

    monkeypatch.setattr(heartbeat, "INTERVAL_S", 0.01)
    hb = object.__new__(heartbeat.Heartbeat)
    blamed = []
    hb.rank, hb.server, hb.limit_s, hb._lock, hb._stop = 0, 0, 0.05, threading.Lock(), threading.Event()
    hb._answered = time_mod.monotonic()
    hb._moved = [time_mod.monotonic()] * 2
    hb._blame = lambda rank, seconds, why: blamed.append((rank, why))
    watch = threading.Thread(target=hb._watch, daemon=True)
    watch.start()
    watch.join(timeout=30)
    assert not watch.is_alive() and blamed == [(1, "no heartbeat")]


class _Silent:
    """A leader's Liveness as ``agree`` reads it: who has been silent (n2's worker, rank 3)."""

    def __init__(self, silent: set[int]):
        self._silent = silent

    def silent(self, ranks, for_s):
        return {r for r in ranks if r in self._silent}


class _Counting:
    """A store that counts the reads of workers' arrival keys (``g1/here/<rank>``)."""

    def __init__(self, store):
        self.store, self.reads = store, 0

    def __getattr__(self, name):
        def op(*args):
            if name == "check":
                self.reads += sum("/here/" in key for key in args[0])
            return getattr(self.store, name)(*args)

        return op


def test_the_leader_reads_who_arrived_only_when_one_more_did_and_decides_without_the_silent_node():
    import torch.distributed as dist

    store = _Counting(dist.HashStore())
    in_place.open_next(store, GEN, 0, "rank 0 (n0:0) failed: Connection closed by peer")
    later = threading.Timer(0.5, lambda: [in_place.open_next(store, GEN, r, "closed") for r in (1, 2)])
    later.start()
    try:
        decision = in_place.agree(store, GEN, 0, _Silent({3}), timeout_s=30)
    finally:
        later.join()
    assert decision == Decision((0, 1, 2), ("n2",), "rank 0 (n0:0) failed: Connection closed by peer")
    assert store.store.get("g1/decision").decode() == decision.to_json()
    # the leader reads the missing workers' keys when the arrival counter moves (at most 4 + 3 + 2, whatever the
    # machine's speed), the workers their own once each (3): not every worker's key every 50 ms poll (~40 in 0.5 s)
    assert store.reads <= 12, store.reads
