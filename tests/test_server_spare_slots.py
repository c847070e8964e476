"""PUTs into a kvtier-server whose RAM is full go through spare slots (kvtier.tiers.cpu, "Spare
slots"; kvtier.server.tenant_budget.spare_slots): each chunk is received or copied into a slot beyond
the capacity, verified there, and only then evicts. A real server process: over the socket
(PUT runs) a refused chunk evicts nothing and the good ones all land; over shared memory the
chunks that land in spare slots are read back through the client's mapping of the arena
(which must cover the spares)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.config import GrpcTierConfig
from kvtier.server.tenant_budget import spare_slots
from kvtier.tiers.base import Entry, Miss
from kvtier.tiers.remote import GrpcTier
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server
from tests.test_server_direct_put import fill_refuse_and_refill

SLOTS = 32
CHUNK_BYTES = 100_000


@pytest.fixture()
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(tmp_path_factory.mktemp("spare-slots"), "--cpu-bytes", f"{SLOTS * 128}KiB",
                     "--slot-bytes", "128KiB", "--set", "max_chunk_bytes=1MiB", "--set", "cpu.policy=lru")
    yield s
    assert s.alive(), s.log
    assert s.stop() == 0, s.log
    assert "Traceback" not in s.log, s.log


def test_this_server_has_spare_slots() -> None:
    assert spare_slots(SLOTS) == 2 and spare_slots(15) == 0 and spare_slots(10_000) == 8


def test_socket_puts_into_a_full_ram_evict_only_for_verified_chunks(server: ServerProc) -> None:
    # more refusals than there are spares: none costs a chunk or a slot
    fill_refuse_and_refill(server, SLOTS, CHUNK_BYTES, seed=21, refusals=3)


def test_shm_puts_into_a_full_ram_are_read_back_through_the_arena(server: ServerProc) -> None:
    keys = make_keys(3 * SLOTS, seed=22)
    chunks = {k: make_chunk(k, CHUNK_BYTES, seed=i) for i, k in enumerate(keys)}
    tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(server.address,), data_path="shm", timeout_s=30))
    try:
        data = tier.nodes[0].data
        assert data is not None and data.kind == "shm"
        for i in range(0, len(keys), 8):  # the last two thirds each evict
            batch = keys[i : i + 8]
            assert tier.put([Entry(k, chunks[k]) for k in batch]) == [True] * 8
            got = tier.get(batch)  # arena reads: some of these lie in spare slots
            assert [bytes(g) for g in got if not isinstance(g, Miss)] == [chunks[k] for k in batch]
            assert tier.nodes[0].data is data  # read on the data path, not after a fall back to gRPC
        held = tier.probe(keys[-SLOTS:])
        assert held.hits == SLOTS
        assert tier.probe(keys[:SLOTS]).hits == 0
    finally:
        tier.close()
