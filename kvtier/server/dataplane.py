"""The bulk data path: kvtier.protocol.frames frames over TCP (or TLS), one thread per connection.

Why threads and not the asyncio loop: a thread blocked in ``recv_into``/``sendmsg`` releases
the GIL, bodies land straight in their buffer (no asyncio StreamReader copies) and chunk
replies go out with one scatter/gather ``sendmsg`` (header + the tier's bytes, no join).
Measured on this class of machine, a thread-per-connection socket server moves ~3x what gRPC
does. Connections are bounded (``max_data_connections``).

Security: the first frame must be HELLO with a bearer token the same :class:`Authenticator`
as the gRPC side accepts; the connection then serves that tenant's store only. TLS (and mTLS)
uses the gRPC side's certificates. Until HELLO is accepted a peer may send only HELLO-sized
frames, holds one of a few unauthenticated slots and has ``handshake_s`` in all (see
:mod:`kvtier.server.admission`). A frame the protocol forbids gets an ERROR frame with the
reason (INVALID_ARGUMENT) and the connection is closed.

PUT batches are all or nothing, as on the gRPC side: items are checked as they arrive; when
one is refused the chunks this batch newly stored are removed again and the reply is one
ERROR, so a refused batch leaves nothing behind (chunks that were there before stay).
On a RAM-only store a PUT's chunk is received straight into a RAM slot reserved for it
(:class:`kvtier.server.put_run.DirectPut`; published only once verified, and only then
evicting where RAM is full: kvtier.tiers.cpu, "Spare slots"), so the kernel's copy is the
only one; on plain TCP a PUT batch's frames are received in runs by a C loop
(:class:`kvtier.server.put_run.PutRuns`).
GET replies are :mod:`kvtier.server.data_get`'s (RAM hits sent from the arena, no copy).
LOOKUP answers as the gRPC ``Lookup`` does (the tenant store's probe, counted as a client
lookup), without gRPC's per-call cost; WELCOME names it in ``ops`` so that clients send it
only to servers that have it.

Shared memory (same host, ``shm_bytes`` > 0): on SHM_OPEN the server makes a sealed memfd
for this connection and hands its descriptor to the client over a one-shot Unix socket
(:mod:`kvtier.server.shm`; no name in /dev/shm ever exists, and no one can shrink it under
the server's mapping). GET replies then copy each chunk from the tier straight into the
segment and send a 16-byte reference; PUTs reference chunks the client wrote there. The
kernel copies nothing. A client that cannot take the segment keeps using the socket. Trust:
the server verifies a PUT chunk in the segment and then copies it; a client that rewrites
its bytes in between can only corrupt its own tenant's chunk, which readers refuse by
checksum. Each segment is this connection's own: no other connection, tenant or process
is handed its descriptor.

Draining (SIGTERM): the listener closes; connections idle between requests are shut down;
a connection inside a request finishes it, then closes.
"""

from __future__ import annotations

import gc
import logging
import mmap
import socket
import ssl
import threading
import time
from functools import partial

import grpc

from kvtier.protocol.accept import Acceptor
from kvtier.protocol.frames import (
    OP_LOOKUP,
    Frame,
    FrameReader,
    LookupKeys,
    ProtocolError,
    PutItem,
    ShmRef,
    WireLimits,
    encode_error,
    encode_lookup_reply,
    encode_put_reply,
    encode_welcome,
)
from kvtier.protocol.session import ServerSession, ShmControl
from kvtier.protocol.socket_io import read_frame, send_all, set_kernel_timeouts
from kvtier.server import put_run
from kvtier.server import shm as shm_segment
from kvtier.server.admission import Admission, Conn
from kvtier.server.arena_refs import ArenaRefs
from kvtier.server.auth import Authenticator, AuthError
from kvtier.server.data_get import GetReplier
from kvtier.server.metrics import ServerMetrics
from kvtier.server.requests import BadRequest, Limits, make_entry
from kvtier.server.shm_control import answer_shm_control
from kvtier.server.storage import Storage, TenantStore
from kvtier.tiers.cpu import Reservation

log = logging.getLogger(__name__)
IDLE_TIMEOUT_S = 600.0
ERROR_SEND_S = 1.0  # at most this long to tell a misbehaving peer why it is cut off
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


class _Batch:
    """The PUT batch in progress on a connection: per-item results, the first refusal, and
    the keys it newly stored (removed again if the batch is refused)."""

    def __init__(self) -> None:
        self.flags: list[bool] = []
        self.error: BadRequest | None = None
        self.new_keys: list[bytes] = []


class DataPlane:
    def __init__(self, storage: Storage, auth: Authenticator, limits: Limits, metrics: ServerMetrics,
                 tls: ssl.SSLContext | None, max_connections: int, shm_bytes: int = 0,
                 max_unauthenticated: int = 32, handshake_s: float = 5.0, max_per_tenant: int = 0,
                 arena_reads: bool = True) -> None:
        self.storage = storage
        self.auth = auth
        self.limits = limits
        self.wire_limits = WireLimits(limits.max_chunk_bytes, limits.max_batch_keys)
        self.metrics = metrics
        self.tls = tls
        self.max_connections = max_connections
        self.replier = GetReplier(metrics, storage.slot_bytes())
        # Series every PUT item updates, looked up once (as GetReplier does).
        self._bytes_in = {path: metrics.bytes.labels("in", path) for path in ("socket", "shm")}
        self._put_ok = metrics.requests.labels("data.Put", "OK")
        self.shm_bytes = shm_bytes if shm_segment.AVAILABLE else 0
        self.arena_reads = arena_reads
        self.admission = Admission(max_connections, max_unauthenticated, handshake_s, max_per_tenant)
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._conns: set[Conn] = set()
        self._threads: set[threading.Thread] = set()
        self._draining = False
        self._acceptor: threading.Thread | None = None

    def start(self, host: str, port: int) -> int:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        self._listener = sock
        self.admission.start()
        self._acceptor = threading.Thread(target=self._accept_loop, name="kvtier-data-accept", daemon=True)
        self._acceptor.start()
        return int(sock.getsockname()[1])

    def _accept_loop(self) -> None:
        assert self._listener is not None
        acceptor = Acceptor(self._listener, lambda: self._draining, "data path")
        while (accepted := acceptor.next()) is not None:
            sock, peer = accepted
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Conn(sock)
            with self._lock:
                self._conns.add(conn)
            self.admission.arrive(conn)  # may push out the oldest unauthenticated connection
            thread = threading.Thread(target=self._serve, args=(conn, peer), name="kvtier-data", daemon=True)
            with self._lock:
                # A thread stays listed until it has ended (join waits for its last lines too);
                # the ended ones are dropped here.
                self._threads = {t for t in self._threads if t.is_alive()}
                self._threads.add(thread)
            try:
                thread.start()
            except RuntimeError as exc:  # out of threads: this one connection is refused
                log.warning("data path %s: connection refused: %s", peer, exc)
                with self._lock:
                    self._threads.discard(thread)  # never started: nothing to join
                self._forget(conn)

    def _serve(self, conn: Conn, peer: object) -> None:
        self.metrics.data_connections.inc()
        seg = shm_segment.Segment()
        try:
            conn.sock.settimeout(self.admission.handshake_s)  # the reaper enforces the total
            if self.tls is not None:
                conn.sock = self.tls.wrap_socket(conn.sock, server_side=True)
            self._converse(conn, seg)
        except ProtocolError as exc:
            log.info("data path %s: protocol error, connection closed: %s", peer, exc)
            self._send_error(conn.sock, INVALID, f"protocol error: {exc}")
        except (ConnectionError, TimeoutError, ssl.SSLError, OSError) as exc:
            log.debug("data path %s: connection ended: %s", peer, exc)
        finally:
            if seg.mapping is not None and not seg.close():
                # A view of the segment outlived the conversation in a reference cycle (an
                # exception's frames): collect it now, or the mapping waits for the next GC.
                gc.collect()
                seg.close()
            self._forget(conn)
            self.metrics.data_connections.dec()

    def _forget(self, conn: Conn) -> None:
        """The connection leaves admission and this plane's set, then its socket closes."""
        self.admission.leave(conn)  # before close: no shutdown may reach a reused fd
        with self._lock:
            self._conns.discard(conn)
        conn.sock.close()

    @staticmethod
    def _send_error(sock: socket.socket, code: int, message: str) -> None:
        """Best effort: the stream may be half-closed already; the connection ends anyway."""
        try:
            sock.settimeout(ERROR_SEND_S)
            send_all(sock, encode_error(code, message))
        except (OSError, ssl.SSLError):
            pass

    def _converse(self, conn: Conn, seg: shm_segment.Segment) -> None:
        sock = conn.sock
        session = ServerSession(self.wire_limits)
        # Before the token is accepted nothing larger than a HELLO is ever allocated.
        token = session.accept(read_frame(sock, FrameReader(WireLimits.handshake())))
        assert isinstance(token, str)
        try:
            tenant = self.auth.authenticate(token or None)
        except AuthError as exc:
            self.metrics.auth_failures.labels(exc.code).inc()
            send_all(sock, encode_error(getattr(grpc.StatusCode, exc.code).value[0], exc.message))
            return
        refused = self.admission.authenticate(conn, tenant.name)
        if refused:
            send_all(sock, encode_error(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], refused))
            return
        send_all(sock, encode_welcome({"tenant": tenant.name, "max_chunk_bytes": self.limits.max_chunk_bytes,
                                       "max_batch_keys": self.limits.max_batch_keys, "ops": [OP_LOOKUP]}))
        store = self.storage.store(tenant.name)
        # Reused for every chunk this connection sends, and for the chunks of PUTs that do
        # not go straight into a RAM slot. An anonymous mapping: pages become resident only
        # when first written, and then stay (no per-request page faults).
        scratch_map = mmap.mmap(-1, self.limits.max_chunk_bytes)
        scratch = memoryview(scratch_map)
        direct = put_run.DirectPut(store, scratch)
        reader = FrameReader(self.wire_limits, direct.target)
        waitall = self._request_mode(sock)
        # Runs of PUT frames received in C (plain TCP only: it reads the socket's descriptor).
        runs = put_run.PutRuns(sock, store, self.limits.max_chunk_bytes) if waitall and put_run.available() else None
        batch = _Batch()
        pending: Frame | None = None  # a frame a PUT run stopped at, already whole
        refs: ArenaRefs | None = None  # the arena slots the last GET reply named (held till now)
        try:
            while not self._draining:
                conn.idle = not batch.flags
                if runs is not None and pending is None and reader.body_type is None and batch.error is None:
                    ended, pending = runs.receive(session, reader, partial(self._put_run_item, store, batch), seg.view)
                    if refs is not None:  # the client sent its next request: done with them
                        refs.release()
                    if ended:
                        conn.idle = False
                        self._reply_put(sock, store, batch)
                        batch = _Batch()
                        continue
                frame = pending if pending is not None else read_frame(sock, reader, waitall)
                pending = None
                conn.idle = False
                if refs is not None:
                    refs.release()
                request = session.accept(frame)
                if isinstance(request, ShmControl):
                    answer_shm_control(sock, store, seg, request, self.shm_bytes, self.arena_reads)
                    continue
                if isinstance(request, list):
                    if refs is None and seg.arena_mapped:
                        refs = ArenaRefs(store, self.shm_bytes)
                    self.replier.send(sock, store, request, scratch, seg.view, refs)
                    continue
                if isinstance(request, LookupKeys):
                    self._lookup(sock, store, request.keys)
                    continue
                assert isinstance(request, PutItem)
                self._put_item(store, request, batch, seg.view, direct.take())
                if not request.more:
                    self._reply_put(sock, store, batch)
                    batch = _Batch()
                direct.refusing = batch.error is not None  # the rest of a refused batch is drained
        finally:
            if refs is not None:
                refs.release()
            direct.abort()  # a body cut off (or refused by the session) is never published
            self._undo(store, batch)  # a batch that never got its reply leaves nothing behind
            seg.close()

    @staticmethod
    def _request_mode(sock: socket.socket) -> bool:
        """Put an authenticated connection in its request mode; True when reads may use
        MSG_WAITALL. Plain TCP goes blocking with the idle timeout enforced by the kernel
        (SO_RCVTIMEO/SO_SNDTIMEO): a 1 MiB PUT body is then one ``recv_into`` rather than
        a poll and a read per segment the kernel holds. TLS keeps Python's timeout mode
        (an SSL socket does not take MSG_WAITALL). Unauthenticated peers never get here:
        the handshake runs in timeout mode under the reaper's deadline."""
        if isinstance(sock, ssl.SSLSocket):
            sock.settimeout(IDLE_TIMEOUT_S)
            return False
        sock.settimeout(None)
        set_kernel_timeouts(sock, IDLE_TIMEOUT_S)
        return True

    def _lookup(self, sock: socket.socket, store: TenantStore, keys: list[bytes]) -> None:
        start = time.perf_counter()
        probe = store.probe(keys)
        send_all(sock, encode_lookup_reply(probe.hits, probe.reason))
        self.metrics.requests.labels("data.Lookup", "OK").inc()
        self.metrics.seconds.labels("data.Lookup").observe(time.perf_counter() - start)

    def _put_item(self, store: TenantStore, item: PutItem, batch: _Batch, shm: memoryview | None,
                  reserved: Reservation | None = None, payload_hash: int | None = None, path: str = "socket") -> None:
        """Store one item of ``batch`` unless an earlier one was refused (then it is only
        drained). ``reserved``: the RAM slot the chunk was received (or copied) into
        (``item.chunk`` views it), published only once the chunk is verified; ``payload_hash``:
        its xxh3, where the receiver computed it; ``path``: how its bytes came (a metric label)."""
        if batch.error is not None:
            if reserved is not None:
                store.abort(reserved)
            batch.flags.append(False)
            return
        chunk = item.chunk
        if isinstance(chunk, ShmRef):
            if shm is None or not chunk.within(shm.nbytes):
                raise ProtocolError(f"PUT references {chunk} outside any mapped segment")
            chunk, path = shm[chunk.offset : chunk.offset + chunk.length], "shm"
            copied = put_run.copy_into_slot(store, chunk) if reserved is None else None
            if copied is not None:  # verified below as the copy it stores, not the segment
                reserved, payload_hash = copied
                chunk = reserved.view
        try:
            entry = make_entry(item.key, chunk, item.depth, item.parent, self.limits, len(batch.flags), payload_hash)
        except BadRequest as exc:
            if reserved is not None:
                store.abort(reserved)
            batch.error = exc
            batch.flags.append(False)
            self.metrics.rejected.labels(exc.code.name).inc()
            return
        new = not store.holds(item.key)
        ok = store.commit(reserved, entry) if reserved is not None else store.put([entry])[0]
        if ok and new:
            batch.new_keys.append(item.key)
        batch.flags.append(ok)
        self._bytes_in[path].inc(chunk.nbytes)

    def _put_run_item(self, store: TenantStore, batch: _Batch, item: PutItem, reserved: Reservation,
                      payload_hash: int, path: str) -> bool:
        """An item a PUT run received (kvtier.server.put_run); whether the batch still takes items."""
        self._put_item(store, item, batch, None, reserved, payload_hash, path)
        return batch.error is None

    @staticmethod
    def _undo(store: TenantStore, batch: _Batch) -> None:
        if batch.new_keys:
            store.delete(batch.new_keys)
            batch.new_keys = []

    def _reply_put(self, sock: socket.socket, store: TenantStore, batch: _Batch) -> None:
        error = batch.error
        (self._put_ok if error is None else self.metrics.requests.labels("data.Put", error.code.name)).inc()
        if error is not None:
            self._undo(store, batch)
            send_all(sock, encode_error(error.code.value[0], error.message))
        else:
            send_all(sock, encode_put_reply(batch.flags))

    # --- shutdown -------------------------------------------------------------------------------
    def stop_accepting(self) -> None:
        self._draining = True
        if self._listener is not None:
            try:  # on Linux, shutdown wakes a thread blocked in accept(); close alone does not
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        self.admission.stop()
        with self._lock:  # held: a connection leaves the set before its socket is closed
            for conn in self._conns:
                if conn.idle:
                    conn.shutdown()  # wakes its thread's recv with EOF

    def join(self, timeout: float) -> None:
        """After :meth:`stop_accepting`: wait up to ``timeout`` s for the accept loop, every
        connection's thread and the reaper to end; connections still running then are cut."""
        end = time.monotonic() + timeout
        if self._acceptor is not None:  # first: no connection thread starts after the snapshot
            self._acceptor.join(timeout)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))
        with self._lock:
            for conn in self._conns:  # past the grace period: cut them
                conn.shutdown()
        self.admission.join(max(0.0, end - time.monotonic()))
