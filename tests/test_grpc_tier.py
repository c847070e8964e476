"""The grpc tier against real kvtier-server processes: the tier contract over both data paths,
placement, replication and failover (SIGKILL, SIGSTOP), deadlines, and data-path fallback."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import GrpcTierConfig
from kvtier.errors import TierUnavailableError
from kvtier.tiers.base import NODE_DOWN, TIMEOUT, Entry, FilledEntry, Miss, Tier
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


def _cluster(tmp: Path, n: int) -> list[ServerProc]:
    return [start_server(tmp / f"n{i}", "--disk-dir", "disk", "--disk-bytes", "64MiB", name=f"n{i}")
            for i in range(n)]


def _timed(calls: list[tuple[str, float]], name: str, fn: Callable[[], Any]) -> Any:
    start = time.monotonic()
    try:
        return fn()
    finally:
        calls.append((name, time.monotonic() - start))


def test_sigkill_one_of_three_with_replication(tmp_path: Path) -> None:
    nodes = _cluster(tmp_path, 3)
    timeout = 1.0
    tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=tuple(n.address for n in nodes), replication=2,
                                   timeout_s=timeout, backoff_s=0.1, backoff_max_s=0.5))
    try:
        keys = make_keys(60, seed=11)
        chunks = [make_chunk(k, 20_000, i) for i, k in enumerate(keys)]
        assert tier.put([Entry(k, c, depth=i) for i, (k, c) in enumerate(zip(keys, chunks))]) == [True] * 60
        calls: list[tuple[str, float]] = []
        errors: list[BaseException] = []
        misses: list[int] = []
        stop = threading.Event()

        def load_loop() -> None:
            try:
                while not stop.is_set():
                    got = _timed(calls, "get", lambda: tier.get(keys))
                    misses.extend(i for i, g in enumerate(got) if g != chunks[i])
                    _timed(calls, "probe", lambda: tier.probe(keys))
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        loader = threading.Thread(target=load_loop)
        loader.start()
        time.sleep(0.5)
        nodes[0].kill()  # SIGKILL mid-loop
        time.sleep(1.0)
        stop.set()
        loader.join(30)
        assert errors == [] and not loader.is_alive()
        assert misses == [], f"every chunk has a live replica, yet {len(misses)} missed"
        assert len(calls) > 10
        assert max(d for _, d in calls) < timeout + 0.5, sorted(calls, key=lambda c: -c[1])[:3]
        assert tier.probe(keys).hits == 60
        assert nodes[0].address in tier.nodes_down()

        # A second node dies: exactly the chunks whose two replicas are both down miss.
        nodes[1].kill()
        dead = {nodes[0].address, nodes[1].address}
        want_miss = {i for i, k in enumerate(keys) if set(tier.replicas(k)) <= dead}
        assert want_miss, "placement left no key on nodes 0+1 only: pick another seed"
        got = _timed(calls, "get", lambda: tier.get(keys))
        assert {i for i, g in enumerate(got) if isinstance(g, Miss)} == want_miss
        assert {g.reason for g in got if isinstance(g, Miss)} <= {NODE_DOWN}
        assert all(got[i] == chunks[i] for i in range(60) if i not in want_miss)
        assert calls[-1][1] < timeout + 0.5

        # Restart node 0 with its disk dir: its chunks are served again once it is probed back.
        nodes[0] = nodes[0].restart()
        end = time.monotonic() + 15
        while nodes[0].address in tier.nodes_down() and time.monotonic() < end:
            time.sleep(0.05)
        assert nodes[0].address not in tier.nodes_down()
        got = tier.get(keys)
        assert all(got[i] == chunks[i] for i in range(60) if nodes[0].address in tier.replicas(keys[i]))
        assert tier.check() == []
    finally:
        tier.close()
        for n in nodes:
            if n.alive():
                n.stop()


def test_hung_node_times_out_within_deadline_then_recovers(tmp_path: Path) -> None:
    nodes = _cluster(tmp_path, 2)
    timeout = 1.0
    tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=tuple(n.address for n in nodes), replication=1,
                                   timeout_s=timeout, backoff_s=3.0, backoff_max_s=3.0))
    # The backoff outlasts the calls below even on a loaded machine: a shorter one lets a later
    # call legitimately retry the hung node and wait out a second deadline.
    try:
        keys = make_keys(40, seed=12)
        chunks = [make_chunk(k, 8000, i) for i, k in enumerate(keys)]
        assert tier.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True] * 40
        on_hung = {i for i, k in enumerate(keys) if tier.replicas(k) == [nodes[0].address]}
        assert 0 < len(on_hung) < 40
        os.kill(nodes[0].proc.pid, signal.SIGSTOP)  # accepts TCP, answers nothing: a hang
        calls: list[tuple[str, float]] = []
        try:
            first = _timed(calls, "get", lambda: tier.get(keys))
            assert {i for i, g in enumerate(first) if isinstance(g, Miss)} == on_hung
            assert {g.reason for g in first if isinstance(g, Miss)} <= {TIMEOUT, NODE_DOWN}, first
            second = _timed(calls, "get", lambda: tier.get(keys))  # node marked down: no waiting
            assert {g.reason for g in second if isinstance(g, Miss)} == {NODE_DOWN}
            _timed(calls, "probe", lambda: tier.probe(keys))
            _timed(calls, "put", lambda: tier.put([Entry(keys[0], chunks[0])]))
            _timed(calls, "delete", lambda: tier.delete(keys[:1]))
            # The first call waits out its deadline (no longer); later ones skip the down node.
            assert calls[0][1] < timeout + 0.5 and all(d < timeout / 2 for _, d in calls[1:]), calls
        finally:
            os.kill(nodes[0].proc.pid, signal.SIGCONT)
        end = time.monotonic() + 15
        while tier.nodes_down() and time.monotonic() < end:
            time.sleep(0.05)
        assert tier.nodes_down() == []
        got = tier.get(keys[1:])
        assert got == chunks[1:]
    finally:
        tier.close()
        for n in nodes:
            n.stop()


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


@pytest.mark.parametrize("path", ["shm", "socket"])
def test_pooled_connections_survive_a_server_restart(tmp_path: Path, path: str) -> None:
    s = start_server(tmp_path, "--disk-dir", "disk", "--disk-bytes", "16MiB")
    tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(s.address,), data_path=path))
    try:
        keys = make_keys(3, seed=16)
        chunks = [make_chunk(k, 5000, i) for i, k in enumerate(keys)]
        assert tier.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True] * 3
        data = tier.nodes[0].data
        assert data is not None and data.kind == path
        assert s.stop() == 0
        s = s.restart()  # every pooled connection is now dead
        assert tier.get(keys) == chunks
        assert tier.nodes[0].data is data  # replaced connections, kept the fast path
    finally:
        tier.close()
        s.stop()


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


def test_unreachable_node_is_a_miss_not_an_error() -> None:
    tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=("127.0.0.1:1",), timeout_s=0.5))
    try:
        key = make_keys(1)[0]
        start = time.monotonic()
        assert tier.get([key]) == [Miss(NODE_DOWN)]
        assert tier.probe([key]).reason == NODE_DOWN
        assert tier.put([Entry(key, make_chunk(key))]) == [False]
        assert tier.delete([key]) == 0
        assert tier.usage().entries == 0
        assert time.monotonic() - start < 0.5
        assert isinstance(tier, Tier)
    finally:
        tier.close()
