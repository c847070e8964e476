"""The grpc tier's data path against real kvtier-server processes: a node marked down gives its
shared memory back at once, a data port that swallows connections costs a verb only a small
share of its deadline (gRPC carries the bytes in the rest), and get_into takes buffers of any
element format the same way on every path."""

from __future__ import annotations

import gc
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.config import GrpcTierConfig
from kvtier.tiers.base import Entry, Miss
from kvtier.tiers.remote import GrpcTier, data_slot
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(tmp_path_factory.mktemp("data_path"))
    yield s
    assert s.stop() == 0, s.log


def _mapped_memfds() -> set[str]:
    """Inodes of the servers' segments and arenas this process maps."""
    out = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        if re.search(r"memfd:kvtier-(shm|arena)", line):
            out.add(line.split()[4])
    return out


def test_a_node_marked_down_unmaps_its_shared_memory(tmp_path: Path) -> None:
    """SIGKILL a node whose pooled shm connections map segments and its arena; the verb that
    finds it dead marks it down, and that closes its data path: nothing of it stays mapped
    (it stayed until the node came back or the tier closed: 128 MiB of segments + the arena)."""
    before = _mapped_memfds()
    s = start_server(tmp_path)
    tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(s.address,), timeout_s=5, data_path="shm",
                                   connections=3, backoff_s=30, backoff_max_s=30))
    try:
        keys = make_keys(6, seed=21)
        chunks = [make_chunk(k, 50_000, i) for i, k in enumerate(keys)]
        assert tier.put([Entry(k, c, i) for i, (k, c) in enumerate(zip(keys, chunks))]) == [True] * 6
        barrier = threading.Barrier(3)
        errors: list[BaseException] = []

        def read() -> None:  # three at once: three pooled connections, each with a segment
            try:
                barrier.wait(10)
                for _ in range(3):
                    assert tier.get(keys) == chunks
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=read) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
        ours = _mapped_memfds() - before
        assert ours, "the shm data path mapped nothing"
        s.kill()
        assert tier.delete(keys[:1]) == 0  # over gRPC: UNAVAILABLE marks the node down
        assert tier.nodes_down() == [s.address]
        gc.collect()
        assert tier.nodes[0].data is None
        assert not ours & _mapped_memfds()
    finally:
        tier.close()
        s.kill()


class _Blackhole:
    """A stand-in address for a node whose gRPC port works and whose data port takes
    connections but never answers (a firewall that only opens the gRPC port behaves alike):
    on 127.0.0.2, a byte pump to the node's gRPC port, and a listener on the node's data port
    number that is never accepted from (the kernel completes the handshakes, HELLO goes
    unanswered). Threads: one per pumped direction; ``close`` ends them."""

    def __init__(self, server: ServerProc) -> None:
        self.data = socket.create_server(("127.0.0.2", server.ports["data"]), backlog=64)
        self.front = socket.create_server(("127.0.0.2", 0))
        self.address = f"127.0.0.2:{self.front.getsockname()[1]}"
        self._target = ("127.0.0.1", server.ports["grpc"])
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.front.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(self._target)
            self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                self._threads.append(t)
                t.start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:  # the other side or close() ended it
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        for s in (self.front, self.data, *self._socks):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in self._threads:
            t.join(5)


def test_a_data_port_that_never_answers_costs_a_verb_little(server: ServerProc,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each (re-)attach of the data path gets a tenth of the verb's deadline and the retries
    back off, so every get is served over gRPC in good time. The attach had the caller's whole
    deadline: every retry interval one get stalled timeout_s and missed with ``timeout``."""
    monkeypatch.setattr(data_slot, "RETRY_S", 0.2)  # retries due within the test (5 s in use)
    hole = _Blackhole(server)
    timeout = 1.0
    try:
        start = time.monotonic()
        tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(hole.address,), timeout_s=timeout, data_path="socket"))
        try:
            assert time.monotonic() - start < timeout / 2
            client = tier.nodes[0]
            assert client.data is None
            keys = make_keys(4, seed=22)
            chunks = [make_chunk(k, 3000, i) for i, k in enumerate(keys)]
            assert tier.put([Entry(k, c, i) for i, (k, c) in enumerate(zip(keys, chunks))]) == [True] * 4
            slowest, misses = 0.0, []
            end = time.monotonic() + 2.5  # retries due at ~0.2, 0.6, 1.4 s (back-off), not 12 of them
            while time.monotonic() < end:
                t = time.monotonic()
                got = tier.get(keys)
                slowest = max(slowest, time.monotonic() - t)
                misses += [g for g in got if isinstance(g, Miss)]
                time.sleep(0.02)
            assert misses == []
            assert slowest < timeout / 2, slowest  # an attach may take 0.1 s; gRPC keeps the rest
            assert 2 <= client.data_slot.failures <= 5, client.data_slot.failures  # retried, backing off
            assert tier.nodes_down() == []
        finally:
            tier.close()
    finally:
        hole.close()


@pytest.mark.parametrize("path", ["shm", "socket", "grpc"])
def test_get_into_typed_buffers(server: ServerProc, path: str) -> None:
    """Buffers of float16 and of 2-D uint8 are filled by bytes, and results are byte counts,
    on every path (socket: 'corrupt' misses; shm and grpc: ValueError)."""
    tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(server.address,), timeout_s=5, data_path=path))
    try:
        keys = make_keys(4, seed=23)
        chunks = [make_chunk(k, 20_000, i) for i, k in enumerate(keys)]
        assert tier.put([Entry(k, c, i) for i, (k, c) in enumerate(zip(keys, chunks))]) == [True] * 4
        arrays = [np.zeros(len(c) // 2 + 8, dtype=np.float16) for c in chunks[:2]]
        arrays += [np.zeros((2, len(c) // 2 + 8), dtype=np.uint8) for c in chunks[2:]]
        got = tier.get_into(keys, [memoryview(a) for a in arrays])
        assert got == [len(c) for c in chunks]
        assert [a.view(np.uint8).reshape(-1)[: len(c)].tobytes() for a, c in zip(arrays, chunks)] == chunks
        strided = memoryview(np.zeros(2 * len(chunks[0]) + 16, dtype=np.uint8))[::2]
        with pytest.raises(ValueError, match="contiguous"):
            tier.get_into(keys[:1], [strided])
        assert tier.nodes_down() == []
    finally:
        tier.close()
