"""The grpc tier when nodes fail, against real kvtier-server processes: replication across a
SIGKILLed node, a SIGSTOPped (hung) node bounded by the deadline and recovered, pooled
connections across a server restart, and an unreachable node read as a miss, not an error."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import GrpcTierConfig
from kvtier.tiers.base import NODE_DOWN, TIMEOUT, Entry, Miss, Tier
from kvtier.tiers.remote import GrpcTier
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server


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
        nodes[0].hang()  # accepts TCP, answers nothing
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


def test_a_read_skips_a_stalled_replica_before_it_is_marked_down(tmp_path: Path) -> None:
    """R=2, a node hung: probes are answered by the other replicas, their lookups to the hung
    node left waiting. Until that call times out the node is not down, only stalled; a read of keys
    whose best replica it is then goes to the other replica at once (it waited for the hedge,
    half the timeout, on every read)."""
    nodes = _cluster(tmp_path, 3)
    timeout = 2.0
    tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=tuple(n.address for n in nodes), replication=2,
                                   timeout_s=timeout, hedge_after=0.5, group_chunks=1,
                                   backoff_s=30.0, backoff_max_s=30.0))
    try:
        keys = [k for k in make_keys(60, seed=13) if tier.replicas(k)[0] == nodes[0].address][:8]
        chunks = [make_chunk(k, 8000, i) for i, k in enumerate(keys)]
        assert len(keys) == 8 and tier.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True] * 8
        nodes[0].hang()
        try:
            for _ in range(2):  # two lookups the hung node now owes
                assert tier.probe(keys).hits == 8
            time.sleep(timeout * 0.25 + 0.2)  # the lookup to the hung node is owed that long
            start = time.monotonic()
            assert tier.get(keys) == chunks
            took = time.monotonic() - start
            assert tier.nodes_down() == []  # the probe's call to it is still in flight
            assert took < timeout * 0.25, took
        finally:
            os.kill(nodes[0].proc.pid, signal.SIGCONT)
    finally:
        tier.close()
        for n in nodes:
            n.stop()


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
