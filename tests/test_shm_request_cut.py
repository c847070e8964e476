"""A request larger than the shared segment: the data path cuts it into requests that each fit
(kvtier.tiers.remote.batching), so every chunk still travels through shared memory rather than
inline over the socket. A real kvtier-server with a 64 KiB segment per connection; the proof is
its own byte counters by path, and a control with the segment off. GETs go through the segment
with ``arena_reads`` off; with it on (the default), their RAM hits are referenced in the
tenant's arena instead (kvtier.server.arena_refs), in requests cut the same way."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.config import GrpcTierConfig
from kvtier.tiers.base import Entry, FilledEntry
from kvtier.tiers.remote import GrpcTier
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server

CHUNK = 7000  # bytes of payload: ~7.1 KiB chunks, 9 to a 64 KiB segment


def _bytes_by_path(server: ServerProc) -> dict[tuple[str, str], float]:
    out = {}
    for line in server.metrics().splitlines():
        if line.startswith("kvtier_server_chunk_bytes_total{"):
            labels, value = line.rsplit(" ", 1)
            direction = labels.split('direction="')[1].split('"')[0]
            path = labels.split('path="')[1].split('"')[0]
            out[(direction, path)] = float(value)
    return out


@pytest.fixture(name="server_path", params=["arena_reads=false", "arena_reads=true"])
def small_segment_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[ServerProc, str]]:
    """(the server, the path its GETs' RAM hits take out: "arena" or "shm")."""
    s = start_server(tmp_path, "--slot-bytes", "8KiB", "--cpu-bytes", "4MiB", "--set", "shm_bytes=64KiB",
                     "--set", "max_chunk_bytes=8KiB", "--set", request.param)
    yield s, "arena" if request.param.endswith("true") else "shm"
    assert s.stop() == 0, s.log


def test_a_batch_larger_than_the_segment_stays_on_shared_memory(server_path: tuple[ServerProc, str]) -> None:
    server, out = server_path
    tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(server.address,), data_path="shm"))
    try:
        keys = make_keys(40, seed=5)  # ~280 KiB: over four segments' worth in one call
        chunks = [make_chunk(k, CHUNK, seed=i) for i, k in enumerate(keys)]
        assert tier.put([Entry(k, c) for k, c in zip(keys[:20], chunks[:20])]) == [True] * 20

        def filler(chunk: bytes) -> Callable[[memoryview], None]:
            return lambda dst: dst.__setitem__(slice(None), chunk)

        filled = [FilledEntry(k, len(c), filler(c)) for k, c in zip(keys[20:], chunks[20:])]
        assert tier.put_filled(filled) == [True] * 20
        assert tier.get(keys) == chunks
        outs = [memoryview(bytearray(8192)) for _ in keys]
        assert tier.get_into(keys, outs) == [len(c) for c in chunks]
        assert [bytes(o[: len(c)]) for o, c in zip(outs, chunks)] == chunks
        seen: dict[int, bytes] = {}
        assert tier.get_visit(keys, lambda i, view: seen.__setitem__(i, bytes(view))) == [len(c) for c in chunks]
        assert seen == dict(enumerate(chunks))
    finally:
        tier.close()
    moved = _bytes_by_path(server)
    total = sum(len(c) for c in chunks)
    assert moved[("in", "shm")] == total and moved[("in", "socket")] == 0, moved
    assert moved[("out", out)] == 3 * total and moved[("out", "socket")] == 0, moved
    assert moved.get(("out", "shm" if out == "arena" else "arena"), 0) == 0, moved


def test_control_without_a_segment_the_same_calls_go_over_the_socket(tmp_path: Path) -> None:
    """The counters above can tell the paths apart."""
    s = start_server(tmp_path, "--slot-bytes", "8KiB", "--cpu-bytes", "4MiB", "--set", "shm_bytes=0",
                     "--set", "max_chunk_bytes=8KiB")
    tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(s.address,), data_path="auto"))
    try:
        keys = make_keys(12, seed=6)
        chunks = [make_chunk(k, CHUNK, seed=i) for i, k in enumerate(keys)]
        assert tier.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True] * 12
        assert tier.get(keys) == chunks
        moved = _bytes_by_path(s)
        assert moved[("in", "socket")] == sum(map(len, chunks)) and moved[("in", "shm")] == 0, moved
    finally:
        tier.close()
        assert s.stop() == 0, s.log
