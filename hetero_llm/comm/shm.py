"""Shared-memory rings set up from the plan: which rings a plan needs, the space check before any rank starts,
creating and mapping them over the rendezvous store, and sweeping rings left by killed ranks.

The ring protocol itself (slots, counters, futex bells, the memory-order argument) is comm/shm_ring.py.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import platform
import secrets
import signal
import struct
import sys
import threading

import attrs

from hetero_llm.comm.shm_ring import _MAGIC, _META, _READER_PID, Receiver, Ring, RingSpec, Sender
from hetero_llm.errors import LayoutError, RankFailure
from hetero_llm.layout import P2P
from hetero_llm.plan import Plan

PREFIX = "hl-shm"


def shm_dir() -> str:
    """Where the rings' files are created (``HETERO_SHM_DIR`` overrides /dev/shm, for tests)."""
    return os.environ.get("HETERO_SHM_DIR", "/dev/shm")


def unsupported() -> str | None:
    """Why this host cannot run the transport at all, or None."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"the shm transport needs Linux on x86-64 (this host: {platform.system()} {platform.machine()})"
    return None


def mib(n: int) -> str:
    """Bytes for people: KiB below a MiB, else MiB."""
    return f"{n / 2**10:.0f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------------
# Which rings a plan needs (pure: the launcher checks /dev/shm with it before any rank starts)


def ring_specs(plan: Plan) -> list[RingSpec]:
    """Every ring of the plan's SHM boundary groups, in plan order (the plan's ``shm_links``, compiled with it)."""
    return [RingSpec(k.src, k.dst, k.direction, k.slots, k.slot_bytes, k.group) for k in plan.shm_links]


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_space(plan: Plan, ranks: list[int]) -> None:
    """Before ``ranks`` start here: a node set to p2p = 'shm' whose /dev/shm is missing or cannot hold the
    rings those ranks create gets one located error naming the size needed ('auto' falls back at start)."""
    lay = plan.layout
    for i, node in enumerate(lay.cluster.nodes):
        if node.p2p is not P2P.SHM:
            continue
        mine = [r for r in ranks if plan.ranks[r].node == node.name]
        needed = sum(s.size for s in ring_specs(plan) if s.dst in mine)
        if not needed:
            continue
        why = _lacking(needed, f"the stage boundaries of rank(s) {', '.join(map(str, mine))} here")
        if why:
            raise LayoutError(lay.file, f"cluster.nodes[{i}].p2p", f"'shm' {why}")


def _lacking(needed: int, what: str) -> str | None:
    """Why this host's shared memory cannot take ``needed`` bytes now (the fix included), or None."""
    bad = unsupported()
    if bad:
        return f"{bad.removeprefix('the shm transport ')} (set p2p = 'auto' or 'network')"
    where = shm_dir()
    if not os.path.isdir(where):
        return (
            f"needs {mib(needed)} in {where} for {what}, but this host has no {where} "
            "(mount a tmpfs there, or set p2p = 'auto' or 'network')"
        )
    if free_bytes(where) < needed:
        return _too_small(needed, what)
    return None


def _too_small(needed: int, what: str) -> str:
    where = shm_dir()
    return (
        f"needs {mib(needed)} in {where} for {what}, but it has {mib(free_bytes(where))} free (free or enlarge it, "
        "e.g. docker run --shm-size=1g, or set p2p = 'auto' or 'network')"
    )


# ------------------------------------------------------------------------------------------
# Setting up: the receiver creates, the sender maps, both agree over the rendezvous store


@contextlib.contextmanager
def _terminate_as_exit():
    """SIGTERM (the launcher stopping ranks) raises SystemExit while ring files exist, so they are removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def sweep(where: str) -> None:
    """Remove this user's ring files whose creator is dead (killed between creating and unlinking them). Another
    user's are left alone: as root, the sticky bit of /dev/shm would not stop the unlink."""
    try:
        names = os.listdir(where)
    except OSError:
        return
    for name in names:
        parts = name.split(".")
        if parts[0] != PREFIX or len(parts) < 3 or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                path = os.path.join(where, name)
                if os.lstat(path).st_uid == os.geteuid():
                    os.unlink(path)
        except PermissionError:
            pass


def _create(spec: RingSpec, token: str) -> tuple[str, mmap.mmap]:
    """A new ring file, its memory reserved (no SIGBUS later on a full tmpfs), header written, mapped."""
    path = os.path.join(shm_dir(), f"{PREFIX}.{os.getpid()}.{token}.{spec.src}-{spec.dst}-{spec.direction}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, spec.size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without fallocate: size it only
                raise
            os.ftruncate(fd, spec.size)
        mm = mmap.mmap(fd, spec.size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    _META.pack_into(mm, 0, _MAGIC, spec.slots, 0, spec.slot_bytes)
    struct.pack_into("<I", mm, _READER_PID, os.getpid())
    return path, mm


def _open(path: str, spec: RingSpec) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, spec.size)
    finally:
        os.close(fd)
    magic, slots, _, slot_bytes = _META.unpack_from(mm, 0)
    if (magic, slots, slot_bytes) != (_MAGIC, spec.slots, spec.slot_bytes):
        raise OSError(f"{path} is not the ring this rank expects")
    struct.pack_into("<I", mm, 12, os.getpid())
    return mm


Link = Sender | Receiver


@attrs.frozen
class RankRings:
    """The shared-memory rings one rank sends or receives on, and whether its node requires them."""

    rank: int
    specs: tuple[RingSpec, ...]
    required: bool  # the node's p2p is 'shm' (else 'auto': a ring that cannot be made falls back to the network)
    label: str  # "rank 3 (node0)", for messages
    why_required: str  # "cluster.nodes[0].p2p = 'shm'"


def rank_rings(plan: Plan, rank: int) -> RankRings:
    """``rank``'s rings of the plan's shared-memory boundaries (pure: read before the rank starts)."""
    specs = tuple(s for s in ring_specs(plan) if rank in (s.src, s.dst))
    node = plan.ranks[rank].node
    index = next(i for i, n in enumerate(plan.layout.cluster.nodes) if n.name == node)
    required = plan.layout.cluster.nodes[index].p2p is P2P.SHM
    return RankRings(rank, specs, required, f"rank {rank} ({node})", f"cluster.nodes[{index}].p2p = 'shm'")


def connect(rings: RankRings, store, timeout_s: float) -> dict[tuple[int, int, int], Link]:
    """This rank's ends of its shared-memory rings (``open_rings``), by (src, dst, direction)."""
    if not rings.specs:
        return {}
    return open_rings(list(rings.specs), rings.rank, store, timeout_s, rings.required, rings.label, rings.why_required)


def open_rings(
    specs: list[RingSpec],
    rank: int,
    store,
    timeout_s: float,
    required: bool,
    label: str,
    why_required: str = "required",
) -> dict[tuple[int, int, int], Link]:
    """Create the rings ``rank`` receives on, map those it sends on. A ring that cannot be made is an error
    when ``required``, else left out (its boundary uses the network) with one warning line. Every answer
    is in the store before an error is raised, so the peer of a failed ring stops at once too."""
    refusal = "fail" if required else "net"
    problems: list[str] = []
    links: dict[tuple[int, int, int], Link] = {}
    created: dict[tuple[int, int, int], tuple[str, mmap.mmap]] = {}
    mine = [s for s in specs if s.dst == rank]
    token = secrets.token_hex(4)
    with _terminate_as_exit():
        try:
            sweep(shm_dir())
            what = f"rank {rank}'s stage boundaries"
            why = _lacking(sum(s.size for s in mine), what) if mine else None
            for s in mine:  # creating never waits, so no rank waits on one that waits on it
                if why is None:
                    try:
                        created[s.key] = _create(s, token)
                    except OSError as e:
                        why = (
                            _too_small(sum(x.size for x in mine), what)
                            if e.errno == errno.ENOSPC
                            else f"cannot create a ring in {shm_dir()}: {e}"
                        )
                store.set(_key(s), f"ok {created[s.key][0]}" if s.key in created else f"{refusal} {why}")
            if why:
                problems.append(why)
            for s in specs:
                if s.src != rank:
                    continue
                answer = _get(store, _key(s), s.dst, label, timeout_s)
                if answer.startswith("fail "):
                    problems.append(f"rank {s.dst}: {answer[5:]}")
                if not answer.startswith("ok "):
                    continue
                try:
                    mm = _open(answer[3:], s)
                    os.unlink(answer[3:])  # both ends have it mapped: from now on nothing is left behind
                    links[s.key] = Sender(Ring(mm, s, label), timeout_s)
                    store.set(_key(s) + "/opened", "ok")
                except OSError as e:
                    problems.append(f"cannot map rank {s.dst}'s ring ({e}): are both ranks on one host?")
                    store.set(_key(s) + "/opened", f"{refusal} {problems[-1]}")
            for key, (_path, mm) in created.items():
                s = next(x for x in mine if x.key == key)
                answer = _get(store, _key(s) + "/opened", s.src, label, timeout_s)
                if answer == "ok":
                    links[key] = Receiver(Ring(mm, s, label), timeout_s)
                elif answer.startswith("fail "):
                    problems.append(f"rank {s.src}: {answer[5:]}")
        finally:
            for path, _ in created.values():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
    if problems:
        _refuse_or_warn(problems[0], required, label, why_required)
    return links


def _refuse_or_warn(problem: str, required: bool, label: str, why_required: str) -> None:
    """A ring that could not be made: a RankFailure when rings are ``required``, else one warning line."""
    if required:
        raise RankFailure(f"{label}: no shared memory for the stage boundaries ({why_required}): {problem}")
    sys.stderr.write(f"warning: {label}: stage boundaries on this node use the network, not shared memory: {problem}\n")
    sys.stderr.flush()


def _key(s: RingSpec) -> str:
    return f"shm/{s.src}-{s.dst}-{s.direction}"


def _get(store, key: str, peer: int, label: str, timeout_s: float) -> str:
    try:
        return store.get(key).decode()
    except Exception:  # the store's timeout, or its server (rank 0) gone
        raise RankFailure(
            f"{label}: rank {peer} did not set up its end of a shared-memory ring within {timeout_s:g} s"
        ) from None
