"""Peer replicas of elastic snapshots (hetero_llm/checkpoint/replicas.py, snapshots.py): who keeps whose snapshot,
that losing any one node leaves every block with a holder, the replica's checks, and a restart that resumes from
a replica after the writer's node is gone. In one process (the exchange between ranks faked by a mailbox); over
gloo between real nodes: tests/integration/test_elastic_processes.py."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from bench.elastic import snapshot_restart
from hetero_llm.checkpoint import folders, holders, replicas, snapshots, trust
from hetero_llm.errors import RankFailure


@pytest.mark.parametrize(
    "peers",
    [
        ["n0:0", "n1:0", "n0:1", "n1:1"],
        ["n0:0", "n0:1", "n1:0", "n2:0"],
        ["a:0", "b:0", "b:1", "b:2", "c:0"],
        ["n0:0", "n1:0"],
    ],
)
def test_every_rank_is_kept_on_another_node_and_any_one_node_lost_leaves_a_holder(peers):
    kept = replicas.keepers(peers)
    assert sorted(kept) == list(range(len(peers)))
    assert all(replicas.node_of(peers[r]) != replicas.node_of(peers[k]) for r, k in kept.items())
    for lost in {replicas.node_of(p) for p in peers}:
        assert replicas.covered_without(peers, kept, lost)
    every_source = sorted(s for r in range(len(peers)) for s in replicas.sources(kept, r))
    assert every_source == list(range(len(peers)))  # each rank's snapshot has exactly one keeper
    assert replicas.keepers(list(reversed(peers))) != {} and replicas.keepers(peers) == kept  # deterministic


def test_ranks_on_one_node_have_no_replica_and_a_second_loss_is_not_covered():
    assert replicas.keepers(["n0:0", "n0:1"]) == {}
    peers = ["n0:0", "n1:0", "n2:0"]
    kept = replicas.keepers(peers)
    assert kept == {0: 1, 1: 2, 2: 0}
    # a rank's two holders are its node and the next: a rank without either is not covered
    assert not replicas.covered_without(peers, {0: 0, 1: 2, 2: 0}, "n0")


def _fake_exchange(world: int, mailbox: dict):
    """``replicas.exchange`` between threads: ``group`` is the calling rank; every rank of ``world`` meets."""
    barrier = threading.Barrier(world, timeout=60)

    def exchange(group, keeper, from_ranks, pt, record):
        if keeper is not None:
            mailbox[(keeper, group)] = (pt, record)
        barrier.wait()
        got = {s: mailbox.pop((group, s)) for s in from_ranks}
        barrier.wait()
        return got

    return exchange


def _writers(plan, shm: Path, key: bytes, steps, monkeypatch, tamper=None) -> dict[int, snapshots.SnapshotWriter]:
    """Every rank of ``plan`` writes its snapshots of ``steps`` into its node's folder ``shm/NODE/round``, its
    replica exchanged through a mailbox (``tamper``: changes the bytes in it)."""
    mailbox: dict = {}
    exchange = _fake_exchange(plan.world_size, mailbox)
    if tamper is not None:
        fake = exchange

        def exchange(group, keeper, from_ranks, pt, record):
            return {s: tamper(*v) for s, v in fake(group, keeper, from_ranks, pt, record).items()}

    monkeypatch.setattr(snapshots.replicas, "exchange", exchange)
    writers, states = {}, {}
    for r in range(plan.world_size):
        rp, state, optimizer = snapshot_restart.rank_state(plan, r)
        root = shm / replicas.node_of(rp.info.device_id) / "round"
        writers[r] = snapshots.SnapshotWriter(rp, root, key, group=r)
        states[r] = (state, optimizer)
    for step in steps:
        for r, writer in writers.items():
            writer.take(*states[r], step)
    for writer in writers.values():
        writer.thread.join(60) if writer.thread else None
    return writers


def test_a_node_lost_with_its_memory_is_resumed_from_the_replicas_on_the_other(tmp_path, monkeypatch):
    """Stage 1 of both pipelines runs on n1 only: without replicas, losing n1 leaves no holder of it in memory."""
    plan = snapshot_restart.dp_pp_plan(tmp_path)
    assert [rp.info.device_id for rp in map(plan.rank_plan, range(4))] == ["n0:0", "n1:0", "n0:1", "n1:1"]
    shm, key = tmp_path / "shm", trust.run_key(tmp_path / "ckpt")
    writers = _writers(plan, shm, key, [4, 5, 6], monkeypatch)
    assert all(w.failure is None for w in writers.values()), [w.failure for w in writers.values()]
    for node in ("n0", "n1"):  # every rank's two newest steps, on its node and on the other
        files = sorted(p.relative_to(shm / node).as_posix() for p in (shm / node).rglob("rank*.json"))
        assert files == [f"round/step-00000{s}/rank{r}.json" for s in (5, 6) for r in range(4)], files
    own = holders.held(shm / "n0", key)
    assert {(r["rank"], r["step"]) for r in own} == {(r, s) for r in range(4) for s in (5, 6)}  # all vouched for
    shutil.rmtree(shm / "n1")  # n1 lost with its memory
    results = snapshot_restart.agree_round(plan, tmp_path / "ckpt", shm, ["n0"])
    folder = folders.step_folder(tmp_path / "ckpt", 6)
    assert results["n0"][0] == (str(folder), " from a snapshot in memory held on n0"), results
    assert folders.verify(folders.find(tmp_path / "ckpt")) is None  # a complete save, every file checked


def test_a_replica_changed_on_the_way_is_refused_and_fails_the_rank_naming_it(tmp_path, monkeypatch):
    plan = snapshot_restart.dp_pp_plan(tmp_path)
    shm, key = tmp_path / "shm", trust.run_key(tmp_path / "ckpt")
    writers = _writers(plan, shm, key, [4], monkeypatch, tamper=lambda pt, record: (pt[:-1] + b"x", record))
    with pytest.raises(RankFailure, match=r"rank 0 \(n0:0\) could not exchange the replicas .*sha256"):
        writers[0].check()
    assert not list((shm / "n0").rglob("rank1.*"))  # never written where a restart would read it
    record = json.loads((shm / "n1" / "round" / "step-000004" / "rank1.json").read_text())
    with pytest.raises(ValueError, match="not vouched"):  # a record another key signed
        replicas.check_received(b"\0" * 32, "round/step-000004/rank1", b"", json.dumps(record).encode())
