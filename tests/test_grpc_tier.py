"""The grpc tier against real kvtier-server processes: the tier contract over both data paths,
placement, and data-path fallback. Failover (SIGKILL, SIGSTOP, restarts, unreachable nodes)
and deadlines: tests/test_grpc_tier_failover.py."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import GrpcTierConfig
from kvtier.errors import TierUnavailableError
from kvtier.tiers.base import Entry, FilledEntry, Miss
from kvtier.tiers.remote import GrpcTier, Ring
from tests.contract import TierContract
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server

TENANTS = 64
CONTRACT_QUOTA = 1 << 20  # the server's smallest tier (MIN_TIER_BYTES): 256 slots of 4 KiB


@pytest.fixture(scope="module")
def contract_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProc, list[str]]]:
    """One server; each contract tier gets a fresh tenant (an empty namespace of its own)."""
    work = tmp_path_factory.mktemp("contract")
    tokens = [f"contract-token-{i:04d}-{os.urandom(8).hex()}" for i in range(TENANTS)]
    # Each tenant's quota is the contract's capacity: its checks see the bound through usage()
    # and the server's evictions as misses.
    (work / "tokens").write_text("".join(f"{t} tenant{i} {CONTRACT_QUOTA}\n" for i, t in enumerate(tokens)))
    (work / "tokens").chmod(0o600)
    s = start_server(work, "--tokens-file", str(work / "tokens"), "--slot-bytes", "4096",
                     "--cpu-bytes", str(TENANTS * (2 << 20)))
    yield s, tokens
    assert s.stop() == 0, s.log


def _factory(server: tuple[ServerProc, list[str]], used: Counter[str], data_path: str
             ) -> Iterator[Callable[[int], Any]]:
    proc, tokens = server
    made: list[GrpcTier] = []

    def make(capacity_bytes: int) -> GrpcTier:
        token = tokens[sum(used.values())]
        used[token] += 1
        tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(proc.address,), token=token,
                                       data_path=data_path, timeout_s=10))
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


_USED: Counter[str] = Counter()  # tenants handed out, shared by both contract classes


class TestGrpcTierShmPath(TierContract):
    capacity = CONTRACT_QUOTA  # the tenant's quota, which usage() reports
    overfill = 2  # a round trip a put: 2x (eviction: 1x) of 2 KiB chunks overflows 256 slots

    @pytest.fixture
    def make_tier(self, contract_server: tuple[ServerProc, list[str]]) -> Iterator[Callable[[int], Any]]:
        yield from _factory(contract_server, _USED, "shm")


class TestGrpcTierSocketPath(TierContract):
    capacity = CONTRACT_QUOTA
    overfill = 2

    @pytest.fixture
    def make_tier(self, contract_server: tuple[ServerProc, list[str]]) -> Iterator[Callable[[int], Any]]:
        yield from _factory(contract_server, _USED, "socket")


class TestGrpcTierGrpcPath(TierContract):
    capacity = CONTRACT_QUOTA
    overfill = 2

    @pytest.fixture
    def make_tier(self, contract_server: tuple[ServerProc, list[str]]) -> Iterator[Callable[[int], Any]]:
        yield from _factory(contract_server, _USED, "grpc")


def test_data_path_carries_the_bytes(contract_server: tuple[ServerProc, list[str]]) -> None:
    proc, tokens = contract_server
    token = tokens[-1]
    for path in ("auto", "shm", "socket", "grpc"):
        tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(proc.address,), token=token, data_path=path))
        try:
            data = tier.nodes[0].data
            assert (data.kind if data is not None else "grpc") == ("shm" if path == "auto" else path)
            keys = make_keys(4, seed=hash(path) & 0xFFFF)
            chunks = [make_chunk(k, 3900, i) for i, k in enumerate(keys)]  # slots are 4 KiB
            assert tier.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True] * 4
            assert tier.get(keys) == chunks
            outs = [memoryview(bytearray(len(c) + 10)) for c in chunks]
            assert tier.get_into(keys, outs) == [len(c) for c in chunks]
            assert [bytes(o[: len(c)]) for o, c in zip(outs, chunks)] == chunks
            with pytest.raises(ValueError):
                tier.get_into(keys[:1], [memoryview(bytearray(100))])
            big = make_keys(1, seed=99)[0]
            assert tier.put([Entry(big, make_chunk(big, 5000))]) == [False]  # over the advertised max
            # A lying entry is dropped alone; its batch-mates are stored; the fast path stays.
            liar = Entry(keys[1], chunks[0])
            assert tier.put([Entry(keys[0], chunks[0]), liar, Entry(keys[2], chunks[2])]) == [True, False, True]
            corrupt = bytearray(chunks[3])
            corrupt[-1] ^= 1  # header fine, payload checksum wrong: the node refuses (DATA_LOSS)
            assert tier.put([Entry(keys[3], corrupt)]) == [False]
            assert tier.nodes[0].data is data and tier.nodes_down() == []
            assert tier.get(keys[:1]) == chunks[:1]  # still usable after the caller's mistake
        finally:
            tier.close()
    metrics = proc.metrics()
    # GETs on shared memory reference the tenant's arena (kvtier.server.arena_refs): out "arena"
    for line in [f'direction="{d}",path="{p}"' for d, paths in (("in", ("shm", "socket", "grpc")),
                                                                 ("out", ("arena", "socket", "grpc"))) for p in paths]:
        value = next(m for m in metrics.splitlines() if line in m and not m.startswith("#"))
        assert float(value.split()[-1]) > 4 * 3900, value


def test_get_visit_and_put_filled_on_every_data_path(contract_server: tuple[ServerProc, list[str]]) -> None:
    """put_filled stores what each fill writes, get_visit hands back each chunk found (in key
    order of indexes, misses and lying chunks not visited), on every path."""
    proc, tokens = contract_server
    token = tokens[-3]
    for path in ("shm", "socket", "grpc"):
        tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(proc.address,), token=token, data_path=path))
        try:
            keys = make_keys(4, seed=7 + len(path))
            chunks = [make_chunk(k, 3900, i) for i, k in enumerate(keys)]

            def filler(chunk: bytes) -> Callable[[memoryview], None]:
                def fill(dst: memoryview) -> None:
                    dst[:] = chunk
                return fill

            items = [FilledEntry(k, len(c), filler(c), i, keys[i - 1] if i else b"")
                     for i, (k, c) in enumerate(zip(keys, chunks))]
            assert tier.put_filled(items[:3]) == [True] * 3
            assert tier.get(keys[:3]) == chunks[:3]
            seen: dict[int, bytes] = {}

            def visit(i: int, view: memoryview, seen: dict[int, bytes] = seen) -> None:
                assert view.readonly and i not in seen
                seen[i] = bytes(view)

            results = tier.get_visit(keys, visit)
            assert results[:3] == [len(c) for c in chunks[:3]] and isinstance(results[3], Miss)
            assert seen == dict(enumerate(chunks[:3]))
            # A chunk whose header names another key is refused by the node, not stored.
            assert tier.put_filled([FilledEntry(keys[3], len(chunks[0]), filler(chunks[0]))]) == [False]
            assert tier.nodes_down() == []
        finally:
            tier.close()


def test_bad_token_fails_at_construction(contract_server: tuple[ServerProc, list[str]]) -> None:
    proc, _ = contract_server
    with pytest.raises(TierUnavailableError, match="UNAUTHENTICATED"):
        GrpcTier(GrpcTierConfig(enabled=True, nodes=(proc.address,), token="not-a-valid-token-at-all"))


def test_ring_is_stable_and_balanced() -> None:
    nodes = [f"10.0.0.{i}:50051" for i in range(4)]
    keys = make_keys(4000, seed=9)
    ring = Ring(nodes)
    placed = [ring.place(k, 2) for k in keys]
    assert all(len(set(p)) == 2 for p in placed)
    load = Counter(n for p in placed for n in p)
    assert all(abs(load[n] - 2000) < 250 for n in nodes), load
    assert Ring(reversed(nodes)).place(keys[0], 2) == placed[0]  # a set: order does not matter
    # Remove node 3: only keys that had it among their replicas change placement, and the
    # survivors keep their rank order.
    fewer = Ring(nodes[:3])
    for k, before in zip(keys, placed):
        after = fewer.place(k, 2)
        if nodes[3] not in before:
            assert before == after
        else:
            assert [n for n in before if n != nodes[3]] == [n for n in after if n in before]


def test_shm_off_or_unmappable_falls_back_to_socket(tmp_path: Path) -> None:
    s = start_server(tmp_path, "--set", "shm_bytes=0")
    try:
        tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(s.address,), data_path="shm"))
        try:
            assert tier.nodes[0].data is not None and tier.nodes[0].data.kind == "socket"
            key = make_keys(1, seed=14)[0]
            assert tier.put([Entry(key, make_chunk(key))]) == [True]
            assert tier.get([key]) == [make_chunk(key)]
        finally:
            tier.close()
    finally:
        assert s.stop() == 0
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvtier-{s.proc.pid}-")]


def test_no_shared_segment_outlives_its_connection(contract_server: tuple[ServerProc, list[str]]) -> None:
    proc, tokens = contract_server
    tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(proc.address,), token=tokens[-2], data_path="shm",
                                   connections=3))
    keys = make_keys(6, seed=15)
    errors: list[BaseException] = []

    def use() -> None:
        try:
            chunks = [make_chunk(k, 3000) for k in keys]  # 4 KiB slots on this server
            for _ in range(5):
                assert tier.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True] * 6
                assert tier.get(keys) == chunks
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=use) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    # Segments are memfds handed over by descriptor: no name in /dev/shm, ever.
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvtier-{proc.proc.pid}-")]
    maps = Path(f"/proc/{proc.proc.pid}/maps")
    assert "memfd:kvtier-shm" in maps.read_text()
    tier.close()
    end = time.monotonic() + 10  # the server unmaps each segment when its connection ends
    while "memfd:kvtier-shm" in maps.read_text() and time.monotonic() < end:
        time.sleep(0.05)
    assert "memfd:kvtier-shm" not in maps.read_text()


def test_data_path_falls_back_to_grpc(tmp_path: Path) -> None:
    s = start_server(tmp_path, ports=("--port", "0", "--http-port", "-1", "--data-port", "-1"))
    try:
        tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(s.address,), data_path="socket"))
        assert tier.nodes[0].data is None  # none advertised: gRPC carries the bytes
        key = make_keys(1, seed=13)[0]
        assert tier.put([Entry(key, make_chunk(key))]) == [True]
        assert tier.get([key]) == [make_chunk(key)]
        tier.close()
    finally:
        s.stop()
