"""The shared-memory transport (hetero_llm/comm/shm.py): rings, matching, waiting, errors, cleanup, launches.

Rings are tested in one process with two threads as the two ranks (a ``HashStore`` as rendezvous, a
temporary folder as /dev/shm); the transport as a user meets it through real ``hetero-launch`` runs.
Layout invariance with shm is tests/integration/test_invariance.py: its layouts put each pipeline on one node, so
their boundaries use shared memory ('auto'), and two of its cases run with p2p = 'network' as well.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import LAYOUTS, assert_one_error_line, invoke_cli
from hetero_llm import layout as layout_mod
from hetero_llm.comm import shm, shm_ring
from hetero_llm.errors import RankFailure
from hetero_llm.layout import P2P, SHM
from hetero_llm.plan import compile_plan
from hetero_llm.schedule import Direction

QUICKSTART = LAYOUTS / "quickstart.toml"

pytestmark = pytest.mark.skipif(shm.unsupported() is not None, reason="the shm transport needs Linux on x86-64")


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("HETERO_SHM_DIR", str(d))
    return d


def _pair(specs, timeout_s=5.0, required=True):
    """Both ends of ``specs`` between ranks 0 and 1, set up by two threads: ({key: link} of 0, of 1)."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=timeout_s))
    out, errors = [None, None], []

    def rank(r):
        try:
            out[r] = shm.open_rings(specs, r, store, timeout_s, required, f"rank {r}")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


SPEC = shm.RingSpec(0, 1, Direction.FWD, slots=4, slot_bytes=64, group="p2p_fwd[test]")


def test_messages_go_to_the_receive_with_their_tag_in_any_order(shm_dir):
    ends0, ends1 = _pair([SPEC])
    sender, receiver = ends0[SPEC.key], ends1[SPEC.key]
    assert not list(shm_dir.iterdir())  # unlinked once both ends mapped it
    for tag in (3, 1, 2):  # sent in another order than received
        sender.send(torch.full((16,), float(tag)), tag)
    got = {tag: torch.empty(16) for tag in (1, 2, 3)}
    works = {tag: receiver.post(buf, tag) for tag, buf in got.items()}
    for tag in (1, 2, 3):
        works[tag].wait()
        assert torch.equal(got[tag], torch.full((16,), float(tag)))
    # a receive posted before its message arrives; bf16 bytes cross unchanged
    late = receiver.post(buf := torch.empty(32, dtype=torch.bfloat16), 9)
    assert not late.is_completed()
    sender.send(x := torch.randn(32).bfloat16(), 9)
    assert late.is_completed() and torch.equal(buf, x)


def test_a_big_message_is_copied_out_while_it_is_written(shm_dir):
    spec = shm.RingSpec(0, 1, Direction.FWD, slots=2, slot_bytes=3 * shm_ring.CHUNK + 64, group="big")
    ends0, ends1 = _pair([spec])
    x, y = torch.randn((3 * shm_ring.CHUNK + 64) // 4), torch.empty((3 * shm_ring.CHUNK + 64) // 4)
    work = ends1[spec.key].post(y, 1)
    waiter = threading.Thread(target=work.wait)
    waiter.start()
    ends0[spec.key].send(x, 1)
    waiter.join()
    assert torch.equal(x, y)
    # the next message written by hand, half of it published: the receive takes that half, and waits for the rest
    ring, nbytes, z, neg = ends0[spec.key].ring, x.numel() * 4, torch.empty_like(x), -x
    shm_ring._MSG.pack_into(ring.mm, ring.offsets[1], 1, 2, nbytes)
    ctypes.memmove(ring.payloads[1], neg.data_ptr(), shm_ring.CHUNK)
    ring.published.value += shm_ring.CHUNK
    work = ends1[spec.key].post(z, 2)
    assert not work.is_completed() and work.copied == shm_ring.CHUNK
    assert torch.equal(z[: shm_ring.CHUNK // 4], neg[: shm_ring.CHUNK // 4])
    ctypes.memmove(ring.payloads[1] + shm_ring.CHUNK, neg.data_ptr() + shm_ring.CHUNK, nbytes - shm_ring.CHUNK)
    ring.published.value += nbytes - shm_ring.CHUNK
    ring.head.value = 2
    work.wait()
    assert torch.equal(z, neg)


def test_the_ring_wraps_around_many_times(shm_dir):
    ends0, ends1 = _pair([SPEC])
    for i in range(4 * SPEC.slots + 1):
        ends0[SPEC.key].send(torch.tensor([float(i)]), i % 7)
        ends1[SPEC.key].post(buf := torch.empty(1), i % 7).wait()
        assert buf.item() == i


def test_sequence_numbers_catch_a_corrupt_ring(shm_dir):
    ends0, ends1 = _pair([SPEC])
    ends0[SPEC.key].send(torch.ones(4), 5)
    ring = ends1[SPEC.key].ring
    shm_ring._MSG.pack_into(ring.mm, ring.offsets[0], 7, 5, 16)  # the slot claims to hold message 7
    with pytest.raises(RankFailure, match="out of sequence: message 7 in the slot of message 0"):
        ends1[SPEC.key].post(torch.empty(4), 5).wait()


def test_a_message_of_another_size_is_an_error(shm_dir):
    ends0, ends1 = _pair([SPEC])
    with pytest.raises(RankFailure, match="a 68-byte message does not fit the 64-byte slots"):
        ends0[SPEC.key].send(torch.ones(17), 1)
    ends0[SPEC.key].send(torch.ones(4), 1)
    with pytest.raises(RankFailure, match="message tag 1 from rank 0 has 16 bytes, the receive expects 32"):
        ends1[SPEC.key].post(torch.empty(8), 1).wait()


def test_waiting_sleeps_instead_of_spinning(shm_dir):
    ends0, ends1 = _pair([SPEC])
    threading.Timer(0.4, lambda: ends0[SPEC.key].send(torch.ones(4), 1)).start()
    cpu, wall = time.thread_time(), time.perf_counter()
    ends1[SPEC.key].post(torch.empty(4), 1).wait()
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    assert wall >= 0.35
    assert cpu < 0.05, f"the waiting thread used {cpu:.3f} s of CPU in {wall:.3f} s"


def test_a_dead_peer_is_named_instead_of_a_hang(shm_dir):
    ends0, ends1 = _pair([SPEC])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ends1[SPEC.key].ring.writer_pid.value = dead.pid
    # the peer's exit, seen while waiting: not the "waited 5 s" line of the ring's timeout (_pair's timeout_s)
    with pytest.raises(
        RankFailure,
        match=rf"rank 1: shared-memory connection to rank 0 lost: its process {dead.pid} "
        "exited while this rank waited to receive tag 1",
    ):
        ends1[SPEC.key].post(torch.empty(4), 1).wait()


def test_a_peer_that_never_maps_its_ring_leaves_no_file(shm_dir):
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    with pytest.raises(RankFailure, match="rank 1: rank 0 did not set up its end of a shared-memory ring within 1 s"):
        shm.open_rings([SPEC], 1, store, 1.0, True, "rank 1")  # rank 0 never comes
    assert not list(shm_dir.iterdir())


def test_files_of_dead_creators_are_swept(shm_dir):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale, live, other = (
        shm_dir / f"hl-shm.{dead.pid}.ab.0-1-0",
        shm_dir / f"hl-shm.{os.getpid()}.ab.0-1-0",
        shm_dir / f"other.{dead.pid}.x",
    )
    for f in (stale, live, other):
        f.write_bytes(b"x")
    _pair([SPEC])
    assert sorted(shm_dir.iterdir()) == sorted([live, other])


@pytest.mark.skipif(
    os.geteuid() != 0,
    reason="making a file another user's needs root: runs in CI and on the dev machines, which run as root",
)
def test_ring_files_of_another_user_are_never_swept(shm_dir):
    """As root the sticky bit of /dev/shm does not stop an unlink: the sweep itself leaves others' files alone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    theirs, mine = shm_dir / f"hl-shm.{dead.pid}.ab.0-1-0", shm_dir / f"hl-shm.{dead.pid}.cd.0-1-0"
    for f in (theirs, mine):
        f.write_bytes(b"x")
    os.chown(theirs, 65534, 65534)  # nobody's
    shm.sweep(str(shm_dir))
    assert list(shm_dir.iterdir()) == [theirs]
    theirs.unlink()


def test_auto_falls_back_to_the_network_when_shared_memory_is_missing(monkeypatch, capfd):
    monkeypatch.setenv("HETERO_SHM_DIR", "/nonexistent-shm")
    assert _pair([SPEC], required=False) == [{}, {}]
    err = capfd.readouterr().err
    assert (
        "warning: rank 1: stage boundaries on this node use the network, not shared memory: needs 1 KiB in "
        "/nonexistent-shm for rank 1's stage boundaries, but this host has no /nonexistent-shm"
    ) in err
    with pytest.raises(RankFailure, match="no shared memory for the stage boundaries"):
        _pair([SPEC], required=True)


def _plan(*overrides):
    return compile_plan(layout_mod.load(QUICKSTART, list(overrides)))


def test_auto_uses_shm_inside_a_node_of_cpu_ranks_and_the_network_between_nodes(tmp_path):
    assert [g.transport for g in _plan().groups] == [SHM, SHM]
    assert [g.transport for g in _plan("cluster.nodes[0].p2p=network").groups] == ["default", "default"]
    two_nodes = tmp_path / "two.toml"
    two_nodes.write_text(
        QUICKSTART.read_text()
        .replace('devices = ["cpu", "cpu"]', 'devices = ["cpu"]\n[[cluster.nodes]]\nname = "node1"\ndevices = ["cpu"]')
        .replace('["node0:1"]', '["node1:0"]')
    )
    assert [g.transport for g in compile_plan(layout_mod.load(two_nodes)).groups] == ["default", "default"]
    assert layout_mod.load(QUICKSTART).cluster.nodes[0].p2p is P2P.AUTO


def test_ring_sizes_follow_the_boundary_tensor():
    specs = shm.ring_specs(_plan())  # 16 rows in 4 microbatches, seq 64, hidden 64, float32
    assert [(s.src, s.dst, s.direction, s.slots, s.slot_bytes) for s in specs] == [
        (0, 1, Direction.FWD, 4, 4 * 64 * 64 * 4),
        (1, 0, Direction.BWD, 4, 4 * 64 * 64 * 4),
    ]
    bf16 = shm.ring_specs(_plan("train.precision=bf16"))
    assert bf16[0].slot_bytes == 4 * 64 * 64 * 2


def test_shm_dir_too_small_is_one_line_naming_the_size(monkeypatch):
    monkeypatch.setattr(shm, "free_bytes", lambda path: 2**17)
    result = invoke_cli(QUICKSTART, "--quiet", "--set", "cluster.nodes[0].p2p=shm")
    assert_one_error_line(
        result,
        f"{QUICKSTART}: cluster.nodes[0].p2p: 'shm' needs 513 KiB in /dev/shm for the "
        "stage boundaries of rank(s) 0, 1 here, but it has 128 KiB free (free or enlarge it, e.g. "
        "docker run --shm-size=1g, or set p2p = 'auto' or 'network')",
    )


def test_shm_dir_missing_is_one_line_naming_the_size(monkeypatch):
    monkeypatch.setenv("HETERO_SHM_DIR", "/nonexistent-shm")
    result = invoke_cli(QUICKSTART, "--rank", "1", "--set", "cluster.nodes[0].p2p=shm")
    assert_one_error_line(
        result,
        f"{QUICKSTART}: cluster.nodes[0].p2p: 'shm' needs 256 KiB in /nonexistent-shm for "
        "the stage boundaries of rank(s) 1 here, but this host has no /nonexistent-shm (mount a "
        "tmpfs there, or set p2p = 'auto' or 'network')",
    )
