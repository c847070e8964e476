"""The bulk data path: kvtier.protocol.frames frames over TCP (or TLS), one thread per connection.

Why threads and not the asyncio loop: a thread blocked in ``recv_into``/``sendmsg`` releases
the GIL, bodies land straight in their buffer (no asyncio StreamReader copies) and chunk
replies go out with one scatter/gather ``sendmsg`` (header + the tier's bytes, no join).
Measured on this class of machine, a thread-per-connection socket server moves ~3x what gRPC
does. Connections are bounded (``max_data_connections``).

Security: the first frame must be HELLO with a bearer token the same :class:`Authenticator`
as the gRPC side accepts; the connection then serves that tenant's store only. TLS (and mTLS)
uses the gRPC side's certificates. A client that says nothing within HANDSHAKE_TIMEOUT_S, or
sends a frame the protocol forbids, is disconnected.

Shared memory (same host, ``shm_bytes`` > 0): on SHM_OPEN the server creates a segment in
/dev/shm (mode 0600, random name) for this connection, the client maps it and says so, and the
name is unlinked at once (the mapping lives until the connection ends; nothing is left behind
even if either side is killed after that point). GET replies then copy each chunk from the
tier straight into the segment and send a 16-byte reference; PUTs reference chunks the client
wrote there. The kernel copies nothing. A client that cannot open the segment (another user,
another /dev/shm) keeps using the socket. Trust: the server verifies a PUT chunk in the shared
segment and then copies it; a client that rewrites its bytes in between can only corrupt its
own tenant's chunk, which readers refuse by checksum.

Draining (SIGTERM): the listener closes; connections idle between requests are shut down;
a connection inside a request finishes it, then closes.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Sequence

import grpc

from kvtier.protocol.frames import (
    SHM_OPEN,
    FrameReader,
    ProtocolError,
    PutItem,
    ShmRef,
    WireLimits,
    encode_chunk,
    encode_chunk_ref,
    encode_error,
    encode_miss,
    encode_put_reply,
    encode_shm_ready,
    encode_welcome,
)
from kvtier.protocol.session import ServerSession, ShmControl
from kvtier.protocol.socket_io import read_frame, send_all
from kvtier.server.auth import Authenticator, AuthError
from kvtier.server.metrics import ServerMetrics
from kvtier.server.requests import BadRequest, Limits, make_entry
from kvtier.server.storage import Storage, TenantStore
from kvtier.tiers.base import Miss

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
HANDSHAKE_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 600.0
Buffer = bytes | memoryview


class _Segment:
    """This connection's shared segment: created, named until the client mapped it, then
    anonymous (unlinked) until the connection closes."""

    def __init__(self) -> None:
        self.name = ""
        self.mapping: mmap.mmap | None = None
        self.view: memoryview | None = None

    def create(self, size: int) -> None:
        self.name = f"kvtier-{os.getpid()}-{secrets.token_hex(12)}"
        fd = os.open(os.path.join(SHM_DIR, self.name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            # Reserve every page now: a sparse file on a small tmpfs (Docker's 64 MiB /dev/shm)
            # would SIGBUS a writer later instead of failing here with ENOSPC.
            os.posix_fallocate(fd, 0, size)
            self.mapping = mmap.mmap(fd, size)
        except OSError:
            self.unlink()
            raise
        finally:
            os.close(fd)

    def unlink(self) -> None:
        if self.name:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass
            self.name = ""

    def close(self) -> None:
        self.unlink()
        self.view = None
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:  # a view is still alive somewhere: the GC unmaps it later
                pass
            self.mapping = None


class DataPlane:
    def __init__(self, storage: Storage, auth: Authenticator, limits: Limits, metrics: ServerMetrics,
                 tls: ssl.SSLContext | None, max_connections: int, shm_bytes: int = 0) -> None:
        self.storage = storage
        self.auth = auth
        self.limits = limits
        self.wire_limits = WireLimits(limits.max_chunk_bytes, limits.max_batch_keys)
        self.metrics = metrics
        self.tls = tls
        self.max_connections = max_connections
        self.shm_bytes = shm_bytes if os.path.isdir(SHM_DIR) else 0
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, bool] = {}  # connection -> idle between requests
        self._threads: set[threading.Thread] = set()
        self._draining = False

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
        thread = threading.Thread(target=self._accept_loop, name="kvtier-data-accept", daemon=True)
        thread.start()
        return int(sock.getsockname()[1])

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._draining:
            try:
                conn, peer = listener.accept()
            except OSError:
                return  # listener closed (draining)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns[conn] = True
            if full:
                self._refuse(conn)
                continue
            thread = threading.Thread(target=self._serve, args=(conn, peer), name="kvtier-data", daemon=True)
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _refuse(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(1.0)
            send_all(conn, encode_error(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                        f"max_data_connections={self.max_connections} reached"))
        except OSError:
            pass
        conn.close()

    def _serve(self, raw: socket.socket, peer: object) -> None:
        self.metrics.data_connections.inc()
        conn = raw
        try:
            raw.settimeout(HANDSHAKE_TIMEOUT_S)
            if self.tls is not None:
                conn = self.tls.wrap_socket(raw, server_side=True)
                with self._lock:
                    self._conns[conn] = self._conns.pop(raw, True)
            self._converse(conn)
        except (ProtocolError, ConnectionError, TimeoutError, ssl.SSLError, OSError) as exc:
            log.debug("data path %s: connection ended: %s", peer, exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
                self._conns.pop(raw, None)
                self._threads.discard(threading.current_thread())
            conn.close()
            self.metrics.data_connections.dec()

    def _converse(self, conn: socket.socket) -> None:
        reader = FrameReader(self.wire_limits)
        session = ServerSession(self.wire_limits)
        token = session.accept(read_frame(conn, reader))
        assert isinstance(token, str)
        try:
            tenant = self.auth.authenticate(token or None)
        except AuthError as exc:
            self.metrics.auth_failures.labels(exc.code).inc()
            send_all(conn, encode_error(getattr(grpc.StatusCode, exc.code).value[0], exc.message))
            return
        send_all(conn, encode_welcome({"tenant": tenant.name, "max_chunk_bytes": self.limits.max_chunk_bytes,
                                       "max_batch_keys": self.limits.max_batch_keys}))
        store = self.storage.store(tenant.name)
        # Reused for every chunk this connection sends. An anonymous mapping: pages become
        # resident only when first written, and then stay (no per-request page faults).
        scratch_map = mmap.mmap(-1, self.limits.max_chunk_bytes)
        scratch = memoryview(scratch_map)
        conn.settimeout(IDLE_TIMEOUT_S)
        put_flags: list[bool] = []
        put_error: BadRequest | None = None
        seg = _Segment()
        try:
            while not self._draining:
                self._set_idle(conn, not put_flags)
                frame = read_frame(conn, reader)
                self._set_idle(conn, False)
                request = session.accept(frame)
                if isinstance(request, ShmControl):
                    self._shm_control(conn, seg, request)
                    continue
                if isinstance(request, list):
                    self._get(conn, store, request, scratch, seg.view)
                    continue
                assert isinstance(request, PutItem)
                if put_error is None:
                    try:
                        put_flags.append(self._put(store, request, len(put_flags), seg.view))
                    except BadRequest as exc:
                        put_error = exc
                        self.metrics.rejected.labels(exc.code.name).inc()
                        put_flags.append(False)
                else:
                    put_flags.append(False)  # after a refused item the batch is only drained
                if not request.more:
                    self._reply_put(conn, put_flags, put_error)
                    put_flags, put_error = [], None
        finally:
            seg.close()

    def _shm_control(self, conn: socket.socket, seg: _Segment, request: ShmControl) -> None:
        if request.type == SHM_OPEN:
            if not self.shm_bytes or seg.mapping is not None:
                send_all(conn, encode_error(grpc.StatusCode.FAILED_PRECONDITION.value[0],
                                            "shared memory is off on this server" if not self.shm_bytes
                                            else "this connection has its segment already"))
                return
            try:
                seg.create(self.shm_bytes)
            except OSError as exc:
                log.warning("data path: no shared segment (%s); this connection stays on the socket", exc)
                send_all(conn, encode_error(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], f"no shared segment: {exc}"))
                return
            send_all(conn, encode_shm_ready(seg.name, self.shm_bytes))
            return
        if seg.mapping is None or seg.view is not None:
            raise ProtocolError("SHM_MAPPED without a pending segment")
        seg.unlink()  # mapped or not, the name has served its purpose
        if request.ok:
            seg.view = memoryview(seg.mapping)
        else:
            seg.close()

    def _set_idle(self, conn: socket.socket, idle: bool) -> None:
        with self._lock:
            if conn in self._conns:
                self._conns[conn] = idle

    def _put(self, store: TenantStore, item: PutItem, index: int, shm: memoryview | None) -> bool:
        chunk = item.chunk
        path = "socket"
        if isinstance(chunk, ShmRef):
            if shm is None or not chunk.within(shm.nbytes):
                raise ProtocolError(f"PUT references {chunk} outside any mapped segment")
            chunk, path = shm[chunk.offset : chunk.offset + chunk.length], "shm"
        entry = make_entry(item.key, chunk, item.depth, item.parent, self.limits, index)
        ok = store.put([entry])[0]
        self.metrics.bytes.labels("in", path).inc(chunk.nbytes)
        return ok

    def _reply_put(self, conn: socket.socket, flags: list[bool], error: BadRequest | None) -> None:
        code = "OK" if error is None else error.code.name
        self.metrics.requests.labels("data.Put", code).inc()
        if error is not None:
            send_all(conn, encode_error(error.code.value[0], error.message))
        else:
            send_all(conn, encode_put_reply(flags))

    def _get(self, conn: socket.socket, store: TenantStore, keys: Sequence[bytes], scratch: memoryview,
             shm: memoryview | None) -> None:
        """Each chunk is copied out of the tier into the shared segment (then only a reference
        is sent) or into this connection's scratch buffer (no allocation) and sent at once, so
        the client takes chunk i while chunk i+1 is copied."""
        start = time.perf_counter()
        sent = shared = offset = 0
        for i, key in enumerate(keys):
            if shm is not None and offset < shm.nbytes:
                try:
                    (ref,) = store.get_into([key], [shm[offset:]])
                except ValueError:
                    pass  # does not fit what is left of the segment: inline below
                else:
                    if isinstance(ref, Miss):
                        send_all(conn, encode_miss(i, ref.reason))
                    else:
                        send_all(conn, encode_chunk_ref(i, offset, ref))
                        offset += (ref + 63) & ~63  # cache-line aligned starts
                        shared += ref
                    continue
            try:
                (result,) = store.get_into([key], [scratch])
            except ValueError:  # larger than the scratch buffer (cannot happen within limits)
                (value,) = store.get([key])
                result = value if isinstance(value, Miss) else len(value)
                body: Buffer = value if not isinstance(value, Miss) else b""
            else:
                body = scratch[: result] if not isinstance(result, Miss) else b""
            if isinstance(result, Miss):
                send_all(conn, encode_miss(i, result.reason))
            else:
                send_all(conn, encode_chunk(i, body))
                sent += result
        self.metrics.bytes.labels("out", "socket").inc(sent)
        self.metrics.bytes.labels("out", "shm").inc(shared)
        self.metrics.requests.labels("data.Get", "OK").inc()
        self.metrics.seconds.labels("data.Get").observe(time.perf_counter() - start)

    # --- shutdown -------------------------------------------------------------------------------
    def stop_accepting(self) -> None:
        self._draining = True
        if self._listener is not None:
            try:  # on Linux, shutdown wakes a thread blocked in accept(); close alone does not
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            idle = [c for c, is_idle in self._conns.items() if is_idle]
        for conn in idle:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes its thread's recv with EOF
            except OSError:
                pass

    def join(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))
        with self._lock:
            left = list(self._conns)
        for conn in left:  # past the grace period: cut them
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
