"""A data-path GET's reply: a CHUNK or MISS frame per key, in key order, from a tenant's store.

Where the bytes go: where the client mapped its tenant's arena (kvtier.server.arena_refs), RAM
hits are held and only a reference into the arena is sent (the client's copy is the only one);
otherwise RAM hits are leased (:meth:`TenantStore.leased_ram`) ``lease_keys`` at a
time and a run of them goes out in one scatter/gather ``sendmsg`` straight from the arena (no
copy; the slots are not reused until the send returns, at most the socket's idle timeout, so a
connection keeps at most ``SEND_BATCH_BYTES`` of RAM from reuse); with a shared segment each
chunk is copied into it and only a reference is sent; anything else is read below RAM through
the connection's scratch buffer (no allocation) and sent at once, so the client takes chunk i
while chunk i+1 is read. Threads: one :class:`GetReplier` serves every connection (it keeps
no per-request state). Failure: socket errors propagate (the connection ends).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

from kvtier.memcopy import copy_into
from kvtier.protocol.frames import Buffers, encode_chunk, encode_chunk_ref, encode_miss
from kvtier.protocol.socket_io import send_all
from kvtier.protocol.wire import placed_bytes
from kvtier.server.arena_refs import ArenaRefs
from kvtier.server.metrics import ServerMetrics
from kvtier.server.storage import TenantStore
from kvtier.tiers.base import Miss

SEND_BATCH_BYTES = 16 << 20  # RAM hits sent with one sendmsg, at most
Buffer = bytes | memoryview


class GetReplier:
    def __init__(self, metrics: ServerMetrics, slot_bytes: int) -> None:
        self.metrics = metrics
        # Keys leased together for one sendmsg: about SEND_BATCH_BYTES of RAM slots.
        self.lease_keys = max(1, SEND_BATCH_BYTES // max(1, slot_bytes))
        # The labelled series every GET updates, looked up once (labels() takes a lock and
        # builds a key per call): the same series, the same counts.
        self._ok = metrics.requests.labels("data.Get", "OK")
        self._seconds = metrics.seconds.labels("data.Get")
        self._out_socket = metrics.bytes.labels("out", "socket")
        self._out_shm = metrics.bytes.labels("out", "shm")
        self._out_arena = metrics.bytes.labels("out", "arena")

    def send(self, conn: socket.socket, store: TenantStore, keys: Sequence[bytes], scratch: memoryview,
             shm: memoryview | None, refs: ArenaRefs | None = None) -> None:
        """Answer one GET: a CHUNK or MISS frame per key, in key order, ``lease_keys`` keys at
        a time (:meth:`_send_group` says where the bytes come from and go). ``refs``: the
        connection's arena holds, where the client mapped the arena."""
        start = time.perf_counter()
        offset = 0
        for group in range(0, len(keys), self.lease_keys):
            offset = self._send_group(conn, store, keys, group, scratch, shm, offset, refs)
        self._ok.inc()
        self._seconds.observe(time.perf_counter() - start)

    def _send_group(self, conn: socket.socket, store: TenantStore, keys: Sequence[bytes], base: int,
                    scratch: memoryview, shm: memoryview | None, offset: int, refs: ArenaRefs | None) -> int:
        """Keys ``base`` .. ``base + lease_keys`` of a GET. With ``refs``, RAM hits are held and
        only their place in the arena is sent. Other RAM hits are leased together (one
        lock hold; the slots are not reused until their bytes are sent, at most the socket's
        idle timeout) and a run of them goes out in one ``sendmsg`` straight from the arena
        (no copy); with a shared segment each chunk is copied from the tier into the segment
        and only a reference is sent (from ``offset``). Anything else is read through this
        connection's ``scratch`` buffer (no allocation) and sent at once, so the client takes
        chunk i while chunk i+1 is read. Returns the segment offset after this group."""
        group = keys[base : base + self.lease_keys]
        sent = shared = referenced = 0
        parts: Buffers = []
        held = refs.hold(group) if refs is not None else [None] * len(group)
        rest = [key for key, place in zip(group, held) if place is None]
        with store.leased_ram(rest) as rest_views:
            views = iter(rest_views)
            for j, (key, place) in enumerate(zip(group, held)):
                i = base + j
                if place is not None:  # the client copies it from the arena it mapped
                    parts += encode_chunk_ref(i, place[0], place[1], arena=True)
                    referenced += place[1]
                    continue
                view = next(views)
                if shm is not None and offset < shm.nbytes:
                    if parts:  # frames go out in key order
                        send_all(conn, parts)
                        parts = []
                    n = self._put_in_segment(conn, store, key, view, i, shm, offset)
                    if n is not None:
                        offset += placed_bytes(n) if n > 0 else 0  # as the client places them (cuts its requests)
                        shared += max(n, 0)
                        continue
                if view is not None:  # straight from the arena to the socket, no copy
                    parts += encode_chunk(i, view)
                    sent += view.nbytes
                    continue
                if parts:
                    send_all(conn, parts)
                    parts = []
                sent += self._send_read(conn, store, key, i, scratch)
            if parts:
                send_all(conn, parts)
        if sent:  # (adding 0 changes nothing)
            self._out_socket.inc(sent)
        if shared:
            self._out_shm.inc(shared)
        if referenced:
            self._out_arena.inc(referenced)
        return offset

    @staticmethod
    def _put_in_segment(conn: socket.socket, store: TenantStore, key: bytes, view: memoryview | None, i: int,
                        shm: memoryview, offset: int) -> int | None:
        """Chunk ``i`` copied into the segment at ``offset`` and its reference (or its MISS)
        sent: the chunk's length (-1 for a miss); None when it does not fit what is left."""
        room = shm[offset:]
        if view is not None:
            if view.nbytes > room.nbytes:
                return None
            copy_into(room[: view.nbytes], view)  # the GIL released: connections copy at once
            ref: int | Miss = view.nbytes
        else:
            try:
                (ref,) = store.get_into([key], [room])
            except ValueError:
                return None  # does not fit what is left of the segment: inline
        if isinstance(ref, Miss):
            send_all(conn, encode_miss(i, ref.reason))
            return -1
        send_all(conn, encode_chunk_ref(i, offset, ref))
        return ref

    @staticmethod
    def _send_read(conn: socket.socket, store: TenantStore, key: bytes, i: int, scratch: memoryview) -> int:
        """Chunk ``i`` read from below RAM (or a miss) into ``scratch`` and sent; bytes sent."""
        try:
            (result,) = store.get_into([key], [scratch])
        except ValueError:  # larger than the scratch buffer (cannot happen within limits)
            (value,) = store.get([key])
            result = value if isinstance(value, Miss) else len(value)
            body: Buffer = value if not isinstance(value, Miss) else b""
        else:
            body = scratch[:result] if not isinstance(result, Miss) else b""
        if isinstance(result, Miss):
            send_all(conn, encode_miss(i, result.reason))
            return 0
        send_all(conn, encode_chunk(i, body))
        return result
