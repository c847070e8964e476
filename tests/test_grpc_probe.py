"""The grpc tier's probe against real kvtier-server processes: with replication it counts every
leading key some live replica holds (a hole on one replica hides nothing), a hung replica
neither stalls it nor gets healthy nodes marked down, a call that had no time left before it
sent anything (or less than its fair share) is a timeout that never marks its node down, and
a node that stopped answering is not asked again while its calls wait."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtier.config import GrpcTierConfig
from kvtier.tiers.base import ABSENT, TIMEOUT, Entry, Miss
from kvtier.tiers.remote import GrpcTier
from kvtier.tiers.remote.errors import NodeError
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProc]]:
    work = tmp_path_factory.mktemp("probe")
    nodes = [start_server(work / f"n{i}", name=f"n{i}") for i in range(3)]
    yield nodes
    for n in nodes:
        if n.alive():
            n.proc.send_signal(signal.SIGCONT)  # a test that failed half-way may have left it stopped
            assert n.stop() == 0, n.log


def _nodes_down_once_marked(tier: GrpcTier, address: str, within_s: float) -> list[str]:
    """``tier.nodes_down()`` once ``address`` is among them (a call in flight marks it when it
    times out), or after ``within_s``."""
    end = time.monotonic() + within_s
    while address not in tier.nodes_down() and time.monotonic() < end:
        time.sleep(0.05)
    return tier.nodes_down()


def _tier(nodes: list[ServerProc], **kw: object) -> GrpcTier:
    return GrpcTier(GrpcTierConfig(enabled=True, nodes=tuple(n.address for n in nodes), group_chunks=1,
                                   **kw))  # type: ignore[arg-type]


def _on(nodes: list[ServerProc], address: str) -> GrpcTier:
    """A tier of that one node: to delete a key from one replica only."""
    return _tier([n for n in nodes if n.address == address])


def test_a_hole_on_one_replica_hides_no_later_key(fleet: list[ServerProc]) -> None:
    """Keys k0, k1, k2 with k0 and k2 on node A: k0 lost on A only (the other replica has it),
    k2 lost on its other replica only (A has it). Every key is readable, so probe counts 3
    (it counted 2: A's answer stopped at k0, and k2 past it was taken as absent)."""
    tier = _tier(fleet, replication=2, timeout_s=5)
    try:
        cand = make_keys(200, seed=7)
        k0 = cand[0]
        a = tier.replicas(k0)[0]
        k2 = next(k for k in cand[1:] if a in tier.replicas(k))
        k1 = next(k for k in cand[1:] if k != k2)
        keys = [k0, k1, k2]
        assert tier.put([Entry(k, make_chunk(k, 2000, i), i) for i, k in enumerate(keys)]) == [True] * 3
        other = next(n for n in tier.replicas(k2) if n != a)
        for address, key in ((a, k0), (other, k2)):
            single = _on(fleet, address)
            try:
                assert single.delete([key]) == 1
            finally:
                single.close()
        assert [isinstance(g, Miss) for g in tier.get(keys)] == [False] * 3
        assert tier.probe(keys).hits == 3
        # A key gone from every replica still stops the run there, with the node's reason.
        single = _on(fleet, a)
        try:
            assert single.delete([k2]) == 1
        finally:
            single.close()
        probe = tier.probe(keys)
        assert (probe.hits, probe.reason) == (2, ABSENT)
        assert tier.nodes_down() == []
    finally:
        tier.close()


@pytest.mark.parametrize("path", ["auto", "socket", "grpc"])
def test_a_hung_replica_neither_stalls_a_probe_nor_takes_healthy_nodes_down(fleet: list[ServerProc],
                                                                           path: str) -> None:
    """R=2, one node SIGSTOPped: every key has a healthy replica, so the probe finds all of them
    without waiting for the hung one (it waited the whole deadline and stopped at 4 of 32), and
    only the hung node is marked down, once its own call times out (the next wave used to start
    with the deadline gone, and 'deadline passed' marked every healthy node down)."""
    timeout = 2.0
    tier = _tier(fleet, replication=2, timeout_s=timeout, data_path=path, backoff_s=30, backoff_max_s=30)
    hung = fleet[0]
    try:
        keys = make_keys(32, seed=5)
        assert tier.put([Entry(k, make_chunk(k, 4000, i), i) for i, k in enumerate(keys)]) == [True] * 32
        assert tier.probe(keys).hits == 32
        hung.hang()
        start = time.monotonic()
        probe = tier.probe(keys)
        took = time.monotonic() - start
        assert probe.hits == 32, probe
        assert took < timeout * 0.75, took  # answered by the healthy replicas (~10 ms here)
        # by its own call's timeout; no healthy node
        assert _nodes_down_once_marked(tier, hung.address, timeout + 10) == [hung.address]
        assert tier.probe(keys).hits == 32
        assert not [g for g in tier.get(keys) if isinstance(g, Miss)]
        assert tier.nodes_down() == [hung.address]
    finally:
        hung.proc.send_signal(signal.SIGCONT)
        tier.close()


def test_a_probe_stuck_on_a_hung_node_stops_at_the_deadline(fleet: list[ServerProc]) -> None:
    """R=1: the hung node's first key ends the run with ``timeout`` by the deadline, every key
    before it counted; no later wave starts and no other node is marked down."""
    timeout = 1.0
    tier = _tier(fleet, replication=1, timeout_s=timeout, backoff_s=30, backoff_max_s=30)
    hung = fleet[1]
    try:
        keys = make_keys(64, seed=6)
        assert tier.put([Entry(k, make_chunk(k, 2000, i), i) for i, k in enumerate(keys)]) == [True] * 64
        first_hung = next(i for i, k in enumerate(keys) if tier.replicas(k) == [hung.address])
        hung.hang()
        start = time.monotonic()
        probe = tier.probe(keys)
        took = time.monotonic() - start
        assert (probe.hits, probe.reason) == (first_hung, TIMEOUT)
        assert took < timeout + 1.0, took
        # the call may still be in flight (it stalled)
        assert _nodes_down_once_marked(tier, hung.address, timeout + 10) == [hung.address]
    finally:
        hung.proc.send_signal(signal.SIGCONT)
        tier.close()


@pytest.mark.parametrize("path", ["shm", "socket", "grpc"])
def test_a_call_with_no_time_left_is_a_timeout_that_leaves_the_node_up(fleet: list[ServerProc],
                                                                      path: str) -> None:
    """A call whose deadline passed before it sent anything (a late wave or retry) says
    ``timeout`` with ``down=False``: it says nothing about the node. It said ``down`` on the
    data paths, so one hung replica got every healthy node marked down."""
    tier = _tier(fleet[:1], timeout_s=5, data_path=path)
    try:
        keys = make_keys(4, seed=8)
        chunks = [make_chunk(k, 3000, i) for i, k in enumerate(keys)]
        assert tier.put([Entry(k, c, i) for i, (k, c) in enumerate(zip(keys, chunks))]) == [True] * 4
        client = tier.nodes[0]
        assert (client.data.kind if client.data is not None else "grpc") == path
        past = time.monotonic() - 0.01
        calls = {
            "get": lambda: client.get(keys, past),
            "get_into": lambda: client.get_into(keys, [memoryview(bytearray(4000)) for _ in keys], past),
            "lookup": lambda: client.lookup(keys, past),
            "put": lambda: client.put([Entry(k, c) for k, c in zip(keys, chunks)], past),
        }
        for name, call in calls.items():
            with pytest.raises(NodeError) as caught:
                call()
            assert (caught.value.reason, caught.value.down) == (TIMEOUT, False), (name, caught.value)
        assert tier.get(keys) == chunks  # the connections are still in step
        assert tier.probe(keys).hits == 4 and tier.nodes_down() == []
    finally:
        tier.close()


def _stored_behind_a_healthy_key(tier: GrpcTier, hung: str, seed: int) -> list[bytes]:
    """8 keys, stored and all found, whose first is on a healthy node and second on ``hung``
    (R=1), so the probe's first wave asks both nodes at once (on the pool, not the caller's
    thread)."""
    for s in range(seed, seed + 500):
        keys = make_keys(8, seed=s)
        if tier.replicas(keys[0]) != [hung] and tier.replicas(keys[1]) == [hung]:
            assert tier.put([Entry(k, make_chunk(k, 2000, i), i) for i, k in enumerate(keys)]) == [True] * 8
            assert tier.probe(keys).hits == 8
            return keys
    raise AssertionError("no such key set: pick other seeds")


def test_a_call_given_too_little_time_does_not_mark_a_hung_node_down(fleet: list[ServerProc]) -> None:
    """A call that starts with less than half of ``timeout_s`` left (it waited in the caller's
    pool behind calls to a hung node) and times out is not held against its node: with 96
    threads probing 3 nodes at R=2, one SIGSTOPped node used to starve the pool until calls
    to the healthy ones started late, timed out and marked them down too (every key then
    missed with node_down for the backoff). The same call given its full time marks it down."""
    timeout = 2.0
    hung = fleet[2]
    tier = _tier([hung], timeout_s=timeout, backoff_s=30, backoff_max_s=30)
    try:
        keys = make_keys(4, seed=9)
        assert tier.probe(keys).reason  # connected while the node still answers
        client = tier.nodes[0]
        hung.hang()
        short = time.monotonic() + timeout * 0.2
        with pytest.raises(NodeError) as caught, client.use(short):
            client.lookup(keys, short)
        assert (caught.value.reason, caught.value.down) == (TIMEOUT, False), caught.value
        assert "not held against the node" in str(caught.value)
        full = time.monotonic() + timeout
        with pytest.raises(NodeError) as caught, client.use(full):
            client.lookup(keys, full)
        assert (caught.value.reason, caught.value.down) == (TIMEOUT, True), caught.value
    finally:
        hung.proc.send_signal(signal.SIGCONT)
        tier.close()


def test_a_stalled_node_is_not_asked_again_while_its_calls_wait(fleet: list[ServerProc]) -> None:
    """R=1, a node SIGSTOPped under concurrent probes: until its first call times out and
    marks it down, the node is "stalled" (two or more lookups unanswered for a quarter of
    ``timeout_s``). Probes waiting for it on the pool stop waiting then, and a probe or read
    that comes later gets a ``timeout`` miss at once instead of one more thread held for the
    whole deadline (each waited the 2 s)."""
    timeout = 2.0
    hung = fleet[2]
    tier = _tier(fleet, timeout_s=timeout, backoff_s=30, backoff_max_s=30)
    try:
        keys = _stored_behind_a_healthy_key(tier, hung.address, seed=300)
        hung.hang()
        with ThreadPoolExecutor(2) as callers:  # two engines' lookups: each waits on the pool
            start = time.monotonic()
            firsts = [f.result() for f in [callers.submit(tier.probe, keys) for _ in range(2)]]
            took = time.monotonic() - start
        assert all((p.hits, p.reason) == (1, TIMEOUT) for p in firsts), firsts
        assert took < timeout * 0.6, took  # stopped when the node stalled
        assert tier.nodes_down() == []  # their calls are still in flight: nothing timed out yet
        assert tier.nodes[[n.address for n in tier.nodes].index(hung.address)].stalled
        start = time.monotonic()
        again = tier.probe(keys)
        got = tier.get(keys[1:2])
        took = time.monotonic() - start
        assert (again.hits, again.reason) == (1, TIMEOUT) and got == [Miss(TIMEOUT)]
        assert took < timeout * 0.25, took  # not asked: the node owes answers already
        # by the first calls' own timeouts
        assert _nodes_down_once_marked(tier, hung.address, timeout + 10) == [hung.address]
    finally:
        hung.proc.send_signal(signal.SIGCONT)
        tier.close()


def test_one_slow_lookup_is_waited_for(fleet: list[ServerProc]) -> None:
    """A node that pauses (SIGSTOP, then SIGCONT 0.7 s later: a GC pause, a loaded disk)
    while one probe alone waits for it is not given up on: the probe gets every key once it
    answers, inside the deadline (the first stall rule gave up on its own call at 0.5 s)."""
    timeout = 2.0
    hung = fleet[2]
    tier = _tier(fleet, timeout_s=timeout, backoff_s=30, backoff_max_s=30)
    try:
        keys = _stored_behind_a_healthy_key(tier, hung.address, seed=400)
        hung.hang()
        resume = threading.Timer(0.7, hung.proc.send_signal, (signal.SIGCONT,))
        resume.start()
        start = time.monotonic()
        probe = tier.probe(keys)
        took = time.monotonic() - start
        resume.join()
        assert probe.hits == 8 and 0.6 < took < timeout, (probe, took)
        assert tier.nodes_down() == []
    finally:
        hung.proc.send_signal(signal.SIGCONT)
        tier.close()
