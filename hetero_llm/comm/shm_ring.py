"""The shared-memory ring protocol: one writer, one reader, a file in /dev/shm both map (comm/shm.py sets the
rings up from the plan; this module is the protocol and its memory-order argument).

Shared-memory transport for stage boundaries between ranks of one node (MegatronDPP's intra-node p2p).

A boundary piece between two ranks of one node crosses through a ring buffer in POSIX shared memory
(a file in /dev/shm that both ranks map) instead of gloo over TCP loopback: the sender copies it into
a slot, the receiver copies it out. One ring per (sender, receiver, direction), preallocated from the
plan: a slot holds one piece, and a ring has a slot for every message the pair exchanges in one step
(microbatches x chunks), so a send never waits for room (a sender cannot start the next step before
its receiver has taken this step's messages: that needs the gradients coming back).

Matching: each message carries the ring's sequence number and the tag gloo would match on. The
reader checks every sequence number (a gap or a repeat raises at once: it would be a bug here, never
a mismatched tensor) and hands each message to the posted receive with its tag; one whose receive is
not posted yet stays in its slot, or is set aside when a later message is wanted first (the dynamic
schedule may send backward gradients out of order).

Waiting: a reader with nothing to read sleeps in futex(2) on the ring's data bell, a counter the
writer increments and wakes after each message (one syscall, about 1 us), so an idle rank gives its
core back to the computing ranks; it can spin ``SPIN_S`` first (0: ``bench/comm/shm_bench.py`` measures
why). A big message is written in chunks, each published at once, so the reader copies one out
while the writer copies the next in.

Lifetime: the receiver creates each ring's file (its name carries the creator's pid), the sender maps
it, and the file is unlinked as soon as both have mapped it: from then on only the two mappings hold
the memory, which the kernel frees when both processes are gone, however they end. A rank killed in
that short window leaves its file behind, which the next start on the host removes (its pid is dead).

Memory order: the writer stores the payload, then the head counter; the reader loads the head, then
the payload. x86-64 keeps stores in order and loads in order (TSO), and every store here is its own
C call, so no compiler reorders them; other machines would need fences Python cannot issue, so the
transport is for Linux on x86-64 ('auto' uses the network elsewhere).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading
import time
from collections import deque

import attrs
import torch

from hetero_llm.errors import RankFailure
from hetero_llm.plan.rings import ShmLink
from hetero_llm.schedule import Direction

# A reader spins this long before it sleeps. 0: on 2 shared cores a spinning reader delays the very writer
# it waits for (bench/comm/shm_bench.py: 4 B one-way ~20 us without spinning, ~70 us with 50 us, ~470 us with 500 us).
SPIN_S = 0.0
SLEEP_S = 0.5  # one futex sleep at most, between checks that the peer still lives
CHUNK = 256 << 10  # a bigger message is written in chunks of this size, each published at once
_MAGIC = b"HLSHM001"
_HEADER = 256  # magic, sizes, pids; the counters, each pair on its own cache line
_SLOT_HEADER = 64
_META = struct.Struct("<8sIIQ")  # magic, slots, writer pid, slot bytes (at 0); reader pid at 24
_MSG = struct.Struct("<QqQ")  # sequence number, tag, payload bytes (at the start of each slot)
_READER_PID, _HEAD, _DATA_BELL, _PUBLISHED, _TAIL, _SPACE_BELL, _WRITER_WAITING = 24, 64, 72, 80, 128, 136, 140
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


@attrs.frozen
class RingSpec(ShmLink):
    """The ring of one of the plan's shared-memory links (``plan.rings.ShmLink``: its ranks, direction, slots,
    slot bytes and group), with the file's size in this format."""

    @property
    def key(self) -> tuple[int, int, Direction]:
        return self.src, self.dst, self.direction

    @property
    def size(self) -> int:
        return _HEADER + self.slots * (_SLOT_HEADER + self.slot_bytes)


# ------------------------------------------------------------------------------------------
# futex(2): sleep until a 32-bit counter in shared memory changes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Futex:
    def __init__(self):
        self._call = ctypes.CDLL(None, use_errno=True).syscall
        self._call.restype = ctypes.c_long
        self._call.argtypes = [
            ctypes.c_long,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_uint32,
            ctypes.POINTER(_Timespec),
            ctypes.c_void_p,
            ctypes.c_uint32,
        ]

    def wait(self, addr: int, seen: int, timeout_s: float) -> None:
        """Sleep while the counter at ``addr`` still holds ``seen`` (at most ``timeout_s``). ctypes releases
        the GIL meanwhile. Returns early on a wake, a changed value or a signal: callers look again."""
        ts = _Timespec(int(timeout_s), int(timeout_s % 1 * 1e9))
        self._call(_SYS_FUTEX, addr, _FUTEX_WAIT, seen, ctypes.byref(ts), None, 0)

    def wake(self, addr: int) -> None:
        self._call(_SYS_FUTEX, addr, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


_futex: _Futex | None = None


def futex() -> _Futex:
    global _futex  # one ctypes handle per process, made on first use
    if _futex is None:
        _futex = _Futex()
    return _futex


# ------------------------------------------------------------------------------------------
# One ring: the mapped file and typed views of its counters


class Ring:
    """A mapped ring. Writer-owned: head (messages written), published (payload bytes written, all messages
    together, partly written ones included), data bell. Reader-owned: tail (messages taken), space bell.
    Never unmapped while the process runs: a thread may still sleep on a bell."""

    def __init__(self, mm: mmap.mmap, spec: RingSpec, label: str):
        self.mm, self.spec, self.label = mm, spec, label
        self.head = ctypes.c_uint64.from_buffer(mm, _HEAD)
        self.data_bell = ctypes.c_uint32.from_buffer(mm, _DATA_BELL)
        self.published = ctypes.c_uint64.from_buffer(mm, _PUBLISHED)
        self.tail = ctypes.c_uint64.from_buffer(mm, _TAIL)
        self.space_bell = ctypes.c_uint32.from_buffer(mm, _SPACE_BELL)
        self.writer_waiting = ctypes.c_uint32.from_buffer(mm, _WRITER_WAITING)
        self.reader_pid = ctypes.c_uint32.from_buffer(mm, _READER_PID)
        self.writer_pid = ctypes.c_uint32.from_buffer(mm, 12)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        stride = _SLOT_HEADER + spec.slot_bytes
        self.offsets = [_HEADER + i * stride for i in range(spec.slots)]
        self.payloads = [base + o + _SLOT_HEADER for o in self.offsets]  # addresses

    def ring(self, bell: ctypes.c_uint32) -> None:
        bell.value = bell.value + 1 & 0xFFFFFFFF
        futex().wake(ctypes.addressof(bell))

    def peer_gone(self, peer_pid: int) -> bool:
        try:
            os.kill(peer_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        try:  # an exited child its parent has not reaped yet still answers kill(0)
            return open(f"/proc/{peer_pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):
            return False

    def wait(
        self,
        bell: ctypes.c_uint32,
        done,
        peer_pid: int,
        peer: int,
        what: str,
        timeout_s: float,
        spin_s: float,
        nap_s: float = SLEEP_S,
    ) -> None:
        """Until ``done()``: spin ``spin_s``, then sleep on ``bell`` (``nap_s`` at most at a time); raise if the
        peer dies or ``timeout_s`` passes."""
        addr = ctypes.addressof(bell)
        start = time.monotonic()
        spin_until, check_at = start + spin_s, start + SLEEP_S
        while True:
            seen = bell.value  # read before looking: a change after the look ends the sleep below
            if done():
                return
            now = time.monotonic()
            if now >= check_at:
                if self.peer_gone(peer_pid):
                    raise RankFailure(
                        f"{self.label}: shared-memory connection to rank {peer} lost: its process "
                        f"{peer_pid} exited while this rank waited to {what}"
                    )
                if now - start > timeout_s:
                    raise RankFailure(
                        f"{self.label}: waited {timeout_s:g} s to {what} on the shared-memory ring "
                        f"from rank {self.spec.src} to rank {self.spec.dst} ({self.spec.group})"
                    )
                check_at = now + SLEEP_S
            if now < spin_until:
                continue
            futex().wait(addr, seen, min(nap_s, max(check_at - now, 1e-4)))


def _address(tensor: torch.Tensor, what: str) -> tuple[int, int]:
    """(data address, bytes) of a contiguous CPU tensor."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise RankFailure(f"shm {what} needs a contiguous CPU tensor, got one on {tensor.device}")
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


@attrs.define(eq=False)
class Sent:
    """A send that completed when it was issued (the payload is in the ring)."""

    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True


class Sender:
    """The writing end of one ring (in the sending rank)."""

    def __init__(self, ring: Ring, timeout_s: float):
        self.ring, self.timeout_s = ring, timeout_s

    def send(self, tensor: torch.Tensor, tag: int) -> Sent:
        r, spec = self.ring, self.ring.spec
        src, nbytes = _address(tensor, "send")
        if nbytes > spec.slot_bytes:
            raise RankFailure(
                f"{r.label}: a {nbytes}-byte message does not fit the {spec.slot_bytes}-byte slots of "
                f"the ring to rank {spec.dst} (sized from the plan: the tensor has another shape)"
            )
        n = r.head.value
        if n - r.tail.value >= spec.slots:  # not expected (see the module doc); wait rather than overwrite
            r.writer_waiting.value = 1
            try:  # the reader wakes us only when it sees the flag: short sleeps cover a wake it missed
                r.wait(
                    r.space_bell,
                    lambda: n - r.tail.value < spec.slots,
                    r.reader_pid.value,
                    spec.dst,
                    "find room for a message",
                    self.timeout_s,
                    0.0,
                    nap_s=1e-3,
                )
            finally:
                r.writer_waiting.value = 0
        slot = n % spec.slots
        _MSG.pack_into(r.mm, r.offsets[slot], n, tag, nbytes)  # before any byte is published: TSO
        dst, published = r.payloads[slot], r.published.value
        for lo in range(0, nbytes, CHUNK):  # a big message in chunks: the reader copies one out while
            size = min(CHUNK, nbytes - lo)  # the next goes in
            ctypes.memmove(dst + lo, src + lo, size)
            r.published.value = published + lo + size
            if size < nbytes:
                r.ring(r.data_bell)
        r.head.value = n + 1  # the whole message is there
        r.ring(r.data_bell)
        return Sent()


@attrs.define(eq=False)
class Received:
    """A posted receive: ``wait()`` blocks until its message is in ``buffer``; ``is_completed()`` polls."""

    receiver: Receiver
    buffer: torch.Tensor  # the caller's tensor
    tag: int
    done: bool = False
    copied: int = 0  # bytes of its message copied so far (a big one arrives in chunks)

    def wait(self) -> None:
        self.receiver.wait(self)

    def is_completed(self) -> bool:
        return self.receiver.poll(self)


class Receiver:
    """The reading end of one ring (in the receiving rank). Threads may wait on it together (the dynamic
    schedule watches each receive in its own thread): the lock guards the tail and the matching."""

    def __init__(self, ring: Ring, timeout_s: float):
        self.ring, self.timeout_s = ring, timeout_s
        self.lock = threading.Lock()
        self.posted: dict[int, deque[Received]] = {}
        self.early: dict[int, deque[torch.Tensor]] = {}  # messages taken out of turn, by tag
        self.expected = 0  # the next sequence number
        self.taken = 0  # payload bytes of the messages before it

    def post(self, tensor: torch.Tensor, tag: int) -> Received:
        _address(tensor, "receive")
        work = Received(self, tensor, tag)
        with self.lock:
            kept = self.early.get(tag)
            if kept:
                message = kept.popleft()
                self._copy(work, message.data_ptr(), message.numel(), message.numel())
            else:
                self.posted.setdefault(tag, deque()).append(work)
        return work

    def poll(self, work: Received) -> bool:
        with self.lock:
            if not work.done:
                self._take(work)
            return work.done

    def wait(self, work: Received) -> None:
        r = self.ring
        r.wait(
            r.data_bell,
            lambda: self.poll(work),
            r.writer_pid.value,
            r.spec.src,
            f"receive tag {work.tag}",
            self.timeout_s,
            SPIN_S,
        )

    def _copy(self, work: Received, src: int, upto: int, nbytes: int) -> None:
        """Copy bytes [work.copied, upto) of an ``nbytes`` message at ``src`` into the receive's tensor."""
        dst, size = _address(work.buffer, "receive")
        if size != nbytes:
            raise RankFailure(
                f"{self.ring.label}: message tag {work.tag} from rank {self.ring.spec.src} has "
                f"{nbytes} bytes, the receive expects {size}"
            )
        ctypes.memmove(dst + work.copied, src + work.copied, upto - work.copied)
        work.copied = upto
        work.done = upto == nbytes

    def _take(self, want: Received) -> None:
        """Deliver arrived messages in order to their posted receives, until ``want`` has its message; a
        message ahead of it whose receive is not posted is set aside, one behind it stays in the ring.
        A message still being written goes into its receive as far as it is written."""
        r, spec = self.ring, self.ring.spec
        while not want.done:
            n = self.expected
            complete = n < r.head.value
            if not complete and r.published.value == self.taken:
                return  # nothing of message n yet
            slot = n % spec.slots
            seq, tag, nbytes = _MSG.unpack_from(r.mm, r.offsets[slot])
            if seq != n:
                raise RankFailure(
                    f"{r.label}: shared-memory ring from rank {spec.src} is out of sequence: message "
                    f"{seq} in the slot of message {n} (a bug: please report it)"
                )
            waiting = self.posted.get(tag)
            if not complete:
                if waiting:
                    self._copy(waiting[0], r.payloads[slot], min(r.published.value - self.taken, nbytes), nbytes)
                return
            if waiting:
                self._copy(waiting.popleft(), r.payloads[slot], nbytes, nbytes)
            else:
                kept = torch.empty(nbytes, dtype=torch.uint8)
                ctypes.memmove(kept.data_ptr(), r.payloads[slot], nbytes)
                self.early.setdefault(tag, deque()).append(kept)
            self.expected, self.taken = n + 1, self.taken + nbytes
            r.tail.value = n + 1  # the slot is free again
            r.space_bell.value = r.space_bell.value + 1 & 0xFFFFFFFF
            if r.writer_waiting.value:
                futex().wake(ctypes.addressof(r.space_bell))
