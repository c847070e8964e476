"""Where the data path's PUT chunks land: RAM slots reserved for them, one frame at a time
(:class:`DirectPut`) or, for the rest of a batch, in runs received in C (:class:`PutRuns`).

A PUT batch on the data port is a run of frames, one chunk each. Read one frame at a time in
Python, a 1 MiB chunk costs the server two system calls, three GIL hand-offs (the header,
the body, the checksum) and ~20 µs of interpreter work; with four connections that was most
of the server's user CPU (bench/remote.py, ``socket_put_vs_tcp``). :class:`PutRuns` reads
each request's header; for a PUT it reserves up to :data:`RUN_SLOTS` free RAM slots and lets
kvtier/_putloop.c receive that frame and the batch's next ones into them (keys, chunk and
the following header in one ``recvmsg`` per piece of :data:`PIECE` bytes, each piece hashed
with xxh3 as soon as it is in, while still in cache), the GIL released for the whole run.
Python then hands each item to the data plane exactly as if its frame had been read here
(the same session checks, the same verification, with the hash computed already).

A PUT whose chunk is a reference into the connection's shared segment is taken by the same
loop: the chunk is copied from the segment into the slot and hashed piece by piece as it is
copied. Without it, each such item cost the server a frame read, a copy call and the commit,
each a GIL hand-off, and four connections queued on the GIL with the CPU a third idle
(bench/remote.py, ``shm_put_vs_memcpy``).

Only plain TCP connections to a store that takes direct puts (RAM only) use it; TLS, and a
store with no free slot to reserve (a full RAM tier lends its spare slots, one per run:
kvtier.tiers.cpu, "Spare slots"), keep the frame-by-frame path, as does any frame the C loop
does not take (its header, or for a reference outside the segment, empty or larger than a
slot, the whole frame, goes back to the frame reader, whose checks and messages stay the
only ones). Where the extension is not built, or its hash does
not match the xxhash package's, :func:`available` is False and nothing changes.

Threads: one :class:`PutRuns` per connection, used by that connection's thread only.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

import xxhash

from kvtier.chunk import HEADER_SIZE as CHUNK_HEADER_SIZE
from kvtier.keys import KEY_BYTES
from kvtier.protocol.frames import MORE, PARENT, PUT, SHM, Frame, FrameHeader, FrameReader, PutItem
from kvtier.protocol.session import ServerSession
from kvtier.protocol.wire import HEADER_SIZE, REF_SIZE
from kvtier.server.storage import TenantStore
from kvtier.tiers.cpu import Reservation

log = logging.getLogger(__name__)
RUN_SLOTS = 8  # slots one connection holds while the C loop fills them (each a max-size chunk)
PIECE = 256 << 10  # the C loop hashes a chunk in pieces of this size, each as soon as it is in


def _load() -> Any:
    """kvtier._putloop bound to the xxhash package's XXH3_64bits; None where it is not built,
    cannot find the function, or computes a hash that differs from xxhash's."""
    try:
        from kvtier import _putloop
    except ImportError:
        return None
    consts = (_putloop.HEADER_SIZE, _putloop.KEY_BYTES, _putloop.MORE, _putloop.PARENT, _putloop.SHM,
              _putloop.REF_SIZE)
    if consts != (HEADER_SIZE, KEY_BYTES, MORE, PARENT, SHM, REF_SIZE):
        log.warning("kvtier._putloop was built for another wire format %s: not used", consts)
        return None
    if not _putloop.bind_hash(xxhash._xxhash.__file__):  # type: ignore[attr-defined]
        log.info("kvtier._putloop: XXH3_64bits not found in the xxhash package; not used")
        return None
    for n in (0, 1, 100, 240, 241, 4096, 1 << 20):  # every xxh3 code path: short, mid, long input
        data = bytes(range(256)) * (n // 256) + bytes(n % 256)
        for piece in (1, 7, 1024, PIECE) if n <= 4096 else (1024, PIECE):
            copy = bytearray(n)
            want = xxhash.xxh3_64_intdigest(data)
            if _putloop.copy_hash(copy, data, 0, piece) != want or copy != data:
                log.warning("kvtier._putloop's streaming XXH3_64bits disagrees with xxhash's: not used")
                return None
    return _putloop


_PUTLOOP = _load()


def available() -> bool:
    return _PUTLOOP is not None


def copy_into_slot(store: TenantStore, src: memoryview) -> tuple[Reservation, int] | None:
    """A shared-memory PUT's chunk copied into a RAM slot reserved for it, with the xxh3 of
    the copy's payload (hashed piece by piece right after each is copied, the GIL released:
    four connections copy at once, and what is verified is what is stored). The caller
    verifies, then commits (a spare slot's commit evicts) or aborts the slot. None where the
    C loop is not available or the store has no free or spare slot for it: the caller
    verifies and puts as before."""
    if _PUTLOOP is None:
        return None
    res = store.reserve(src.nbytes)
    if res is None:
        return None
    return res, _PUTLOOP.copy_hash(res.view, src, CHUNK_HEADER_SIZE, PIECE)


class DirectPut:
    """Where a connection's PUT bodies land: the keys in a small buffer and the chunk straight
    in a RAM slot the store reserves for it (:meth:`TenantStore.reserve`: no copy after the
    kernel's), when the store takes it so; else ``spill`` (the connection's scratch buffer,
    which GET replies use between requests) and a copying put, so that a connection never
    holds a second max-size buffer of its own. Holds at most one reservation (the frame being
    received); ``take`` hands it to the put, ``abort`` gives it back when the frame never
    completes. A body in ``spill`` is stored (copied) before the next frame is read."""

    def __init__(self, store: TenantStore, spill: memoryview | None = None) -> None:
        self.store = store
        self.spill = spill
        self.refusing = False  # the batch was refused: its remaining items are only drained
        self.reservation: Reservation | None = None
        self._keys = memoryview(bytearray(2 * KEY_BYTES))

    def target(self, header: FrameHeader) -> tuple[memoryview, memoryview] | None:
        if header.type != PUT or header.flags & SHM:
            return None
        head = 2 * KEY_BYTES if header.flags & PARENT else KEY_BYTES
        if header.length <= head:
            return None  # no chunk: parse_put / verification refuse it
        self.abort()  # (cannot hold one here: the previous frame completed or failed)
        if not self.refusing:
            self.reservation = self.store.reserve(header.length - head)
        if self.reservation is not None:
            return self._keys[:head], self.reservation.view
        if self.spill is not None and header.length - head <= self.spill.nbytes:
            # The chunk at the buffer's start: page-aligned, so a disk tier writes it with
            # O_DIRECT in place rather than through its own per-thread bounce buffer.
            return self._keys[:head], self.spill[: header.length - head]
        return None

    def take(self) -> Reservation | None:
        res, self.reservation = self.reservation, None
        return res

    def abort(self) -> None:
        res = self.take()
        if res is not None:
            self.store.abort(res)


# (item, its slot, payload xxh3, its path: "socket" or "shm") -> whether the batch still takes
# items (False: refused)
PutSink = Callable[[PutItem, Reservation, int, str], bool]


class PutRuns:
    """One connection's run receiver. ``max_chunk``: the largest chunk this server takes."""

    def __init__(self, sock: socket.socket, store: TenantStore, max_chunk: int) -> None:
        self.sock = sock
        self.store = store
        self.capacity = min(max_chunk, store.ram.slot_bytes) if store.ram is not None else 0
        self._head = bytearray(HEADER_SIZE + 2 * KEY_BYTES + REF_SIZE)  # a reference frame, whole
        self._keys = bytearray(RUN_SLOTS * 2 * KEY_BYTES)

    def receive(self, session: ServerSession, reader: FrameReader, sink: PutSink,
                shm: memoryview | None = None) -> tuple[bool, Frame | None]:
        """Read the next frame's header (``reader`` must be between frames); while frames are
        plain PUTs (inline, or referencing ``shm``, the connection's mapped segment) and RAM
        slots are free, receive them in runs, giving each item to ``sink`` in order. Returns (ended, frame): ``ended`` when the last item received ended its
        batch (reply now); else the header of the frame to go on with is in ``reader``
        (``frame``: that frame, when its header was all of it; None: ``read_frame`` reads its
        body). Raises what the socket or the session raises; on any exception the slots not
        yet handed to ``sink`` are given back."""
        assert _PUTLOOP is not None
        self._read_header()
        have, accepting = HEADER_SIZE, True
        while True:
            slots: list[Reservation | None] = list(
                self.store.reserve_many(self.capacity, RUN_SLOTS)
                if accepting and self.capacity and self._head[2] == PUT else [])
            if not slots:
                return False, self._hand_back(reader, have)
            try:
                items, have = _PUTLOOP.recv_puts(self.sock.fileno(), self._head, have, self._keys,
                                                 [res.view for res in slots if res is not None],
                                                 PUT, CHUNK_HEADER_SIZE, PIECE, b"" if shm is None else shm)
                for j, (flags, count, length, digest) in enumerate(items):
                    res = slots[j]
                    assert res is not None
                    keylen = 2 * KEY_BYTES if flags & PARENT else KEY_BYTES
                    chunk = res.view[: length - keylen]
                    keys = memoryview(self._keys)[j * 2 * KEY_BYTES : j * 2 * KEY_BYTES + keylen]
                    # The session sees the frame as if its chunk had come inline (it has: into the
                    # slot). It may refuse it (a batch past max_batch_keys): the slot is still ours
                    # then, and the finally below gives it back.
                    item = session.accept_split_put(flags & ~SHM, count, keys, chunk)
                    slots[j] = None  # the sink owns it now
                    accepting = sink(item, Reservation(res.slot, chunk), digest, "shm" if flags & SHM else "socket")
            finally:
                for left in slots:
                    if left is not None:
                        self.store.abort(left)
            if have == 0:
                return True, None
            if not items or have > HEADER_SIZE:  # a frame the loop does not take
                return False, self._hand_back(reader, have)

    def _read_header(self) -> None:
        """The next frame's header into ``_head``, before any slot is reserved: a connection
        idle between requests holds none."""
        view, got = memoryview(self._head), 0
        while got < HEADER_SIZE:
            n = self.sock.recv_into(view[got:], HEADER_SIZE - got, socket.MSG_WAITALL)
            if n == 0:
                raise ConnectionError("peer closed the connection")
            got += n

    def _hand_back(self, reader: FrameReader, have: int) -> Frame | None:
        """Put what ``_head`` holds (the header, or a reference frame whole) into ``reader``:
        the frame, when that completes it."""
        reader.buffer()[:HEADER_SIZE] = self._head[:HEADER_SIZE]
        frame = reader.advance(HEADER_SIZE)
        if have > HEADER_SIZE:  # the body too: it fits the reader's buffer (SHM frames take no target)
            reader.buffer()[: have - HEADER_SIZE] = self._head[HEADER_SIZE:have]
            frame = reader.advance(have - HEADER_SIZE)
        return frame
