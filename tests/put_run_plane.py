"""The harness of the PUT-run differential fuzz tests (tests/test_put_run_fuzz.py and
tests/test_put_run_shm_fuzz.py): a real DataPlane on a loopback port over a RAM-only store of
small slots, with or without the C run loop; a stream sent to it to its end; and what the
store holds afterwards."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

from kvtier.config import CpuTierConfig, DiskTierConfig
from kvtier.server import put_run
from kvtier.server.auth import Authenticator
from kvtier.server.dataplane import DataPlane
from kvtier.server.metrics import ServerMetrics
from kvtier.server.requests import Limits
from kvtier.server.storage import Storage

SLOT = 64 << 10


class Plane:
    """A running plane: its port, and :meth:`held` once the conversation is over."""

    def __init__(self, server: DataPlane, storage: Storage, port: int) -> None:
        self.server, self.storage, self.port = server, storage, port

    def stop(self) -> None:
        """Stop the server and wait for its connection threads (idempotent)."""
        self.server.stop_accepting()
        self.server.join(10)

    def held(self) -> tuple[dict[bytes, bytes], list[str]]:
        """What the store holds once the server has stopped (no thread can still be storing)."""
        self.stop()
        return holdings(self.storage)


@contextmanager
def plane(with_loop: bool, shm_bytes: int = 0, max_batch_keys: int = 64) -> Iterator[Plane]:
    """A fresh server, the C loop switched off unless ``with_loop``; on exit stopped, its
    storage closed (its warm-ahead thread and arena would otherwise outlive it: a campaign of
    thousands of examples once held 4,000 threads and 6 GiB) and the loop restored."""
    saved = put_run._PUTLOOP
    if not with_loop:
        put_run._PUTLOOP = None
    auth = Authenticator.from_file("")
    storage = Storage(auth.tenants.values(), CpuTierConfig(capacity_bytes=24 * SLOT, slot_bytes=SLOT),
                      DiskTierConfig(enabled=False))
    try:
        server = DataPlane(storage, auth, Limits(max_batch_keys=max_batch_keys, max_chunk_bytes=1 << 20),
                           ServerMetrics(storage), None, 4, shm_bytes=shm_bytes)
        running = Plane(server, storage, server.start("127.0.0.1", 0))
        try:
            yield running
        finally:
            running.stop()
    finally:
        storage.close()
        put_run._PUTLOOP = saved


def send_to_end(sock: socket.socket, stream: bytes) -> bytes | None:
    """Send ``stream``, close our side, and read the answer to its end; None when the server
    reset the connection (closed on a protocol error with our bytes unread: the kernel may
    drop what it had sent back, either path alike)."""
    answer = bytearray()
    try:
        sock.sendall(stream)
        sock.shutdown(socket.SHUT_WR)  # the server sees the end of the stream
        while chunk := sock.recv(1 << 16):
            answer += chunk
    except OSError:
        return None
    return bytes(answer)


def holdings(storage: Storage) -> tuple[dict[bytes, bytes], list[str]]:
    """Every key the (one) tenant's RAM tier holds with its chunk bytes, and its ``check()``
    as of an idle server (a slot still handed to a put is lost capacity)."""
    ram = next(iter(storage.stores.values())).ram
    assert ram is not None
    keys = sorted(ram._map)
    held = dict(zip(keys, (bytes(c) for c in ram.get(keys))))  # type: ignore[arg-type]
    return held, ram.check(idle=True)
