"""Isolation between tenants, end to end, against a real kvtier-server with two tenants: what
one tenant's token can do to another tenant's figures (usage reports) and cache (every data
path: gRPC, the data socket, shared memory and arena reads).
tests/test_server_auth.py holds the basic read/probe/delete/quota matrix; this file the rest."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvtier.config import GrpcTierConfig
from kvtier.tiers.base import ABSENT, Entry, Miss
from kvtier.tiers.remote import GrpcTier, shm_map
from kvtier.usage.reporter import METHOD
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server
from tests.redis_servers import RedisServer, have_redis

ALICE, BOB = "alice-token-0123456789abcdef", "bob-token-0123456789abcdef"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    work = tmp_path_factory.mktemp("isolation")
    tokens = work / "tokens"
    tokens.write_text(f"{ALICE} alice\n{BOB} bob\n")
    tokens.chmod(0o600)
    s = start_server(work, "--tokens-file", str(tokens), "--cpu-bytes", "16MiB", "--slot-bytes", "64KiB")
    yield s
    assert s.stop() == 0, s.log


def _report(replica: str, model: str, prompt: int) -> bytes:
    return json.dumps({"v": 1, "replica": replica, "source": "hf", "model": model, "interval_s": 60,
                       "uptime_s": 1, "seq": 1, "counters": {"prompt_tokens": prompt}}).encode()


def _replicas(server: ServerProc) -> list[dict[str, Any]]:
    with urllib.request.urlopen(server.http + "/api/stats", timeout=10) as resp:
        return json.loads(resp.read())["usage"]["replicas"]  # type: ignore[no-any-return]


def test_one_tenant_cannot_crowd_another_out_of_the_usage_figures(server: ServerProc) -> None:
    """Alice invents 40 model names (the node keeps 32 by name) and 300 replica names (256),
    all live; bob's engine, reporting after that, still shows under its own model and replica
    name. Before, the caps were first come first served across tenants: bob's figures went to
    model "other", replica "other" for the node's lifetime."""
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(METHOD)
        alice = (("authorization", f"Bearer {ALICE}"),)
        for i in range(300):
            call(_report(f"alice-r{i}", f"alice-model-{i % 40}", 1), timeout=5, metadata=alice)
        call(_report("bob-r1", "bob-model", 7), timeout=5, metadata=(("authorization", f"Bearer {BOB}"),))
    reps = _replicas(server)
    bob = [r for r in reps if r["tenant"] == "bob"]
    assert [(r["model"], r["replica"], r["totals"]["prompt_tokens"]) for r in bob] == [("bob-model", "bob-r1", 7)]
    # alice keeps the rest, and loses no tokens: what did not fit is in her own "other".
    assert sum(r["totals"]["prompt_tokens"] for r in reps if r["tenant"] == "alice") == 300
    assert len([r for r in reps if r["replica"] != "other"]) <= 256


def _tier(server: ServerProc, token: str, shm: bool) -> GrpcTier:
    return GrpcTier(GrpcTierConfig(enabled=True, nodes=(server.address,), token=token,
                                   data_path="shm" if shm else "socket"))


@pytest.mark.parametrize("shm", [False, True], ids=["socket", "shm"])
def test_same_key_two_tenants_on_every_path(server: ServerProc, shm: bool) -> None:
    """One chunk key in both tenants: each reads its own bytes on the data socket, through
    shared memory (arena references included) and over gRPC; neither's delete or
    overwrite reaches the other."""
    alice, bob = _tier(server, ALICE, shm), _tier(server, BOB, shm)
    try:
        keys = make_keys(4, seed=31 + shm)
        mine = [make_chunk(k, 30_000, 1) for k in keys]
        theirs = [make_chunk(k, 30_000, 2) for k in keys]
        assert alice.put([Entry(k, c) for k, c in zip(keys, mine)]) == [True] * 4
        assert bob.get(keys) == [Miss(ABSENT)] * 4 and bob.probe(keys).hits == 0
        assert bob.put([Entry(k, c) for k, c in zip(keys, theirs)]) == [True] * 4
        for _ in range(2):  # the second GET of a connection reads through arena references
            assert alice.get(keys) == mine and bob.get(keys) == theirs
        outs = [memoryview(bytearray(65536)) for _ in keys]
        assert bob.get_into(keys, outs) == [len(c) for c in theirs]
        assert [bytes(o[: len(c)]) for o, c in zip(outs, theirs)] == theirs
        assert bob.delete(keys[:2]) == 2
        assert alice.get(keys) == mine and bob.get(keys[:2]) == [Miss(ABSENT)] * 2
    finally:
        alice.close()
        bob.close()


def test_arena_mapping_shows_no_other_tenants_bytes(server: ServerProc) -> None:
    """Bob's read-only mapping of his RAM arena (arena reads) holds his chunks and none of
    alice's bytes: each tenant's arena is its own memfd."""
    alice = _tier(server, ALICE, True)
    keys = make_keys(8, seed=41)
    secret = [make_chunk(k, 40_000, 100 + i) for i, k in enumerate(keys)]
    try:
        assert alice.put([Entry(k, c) for k, c in zip(keys, secret)]) == [True] * 8
        assert alice.get(keys) == secret
    finally:
        alice.close()
    assert not shm_map._arenas, "alice's arena mapping outlived her client"
    bob = _tier(server, BOB, True)
    try:
        own = make_keys(2, seed=42)
        chunks = [make_chunk(k, 40_000, 7 + i) for i, k in enumerate(own)]
        assert bob.put([Entry(k, c) for k, c in zip(own, chunks)]) == [True] * 2
        assert bob.get(own) == chunks
        assert bob.get(own) == chunks  # arena references now
        arenas = [bytes(m) for m, _ in shm_map._arenas.values()]
        assert len(arenas) == 1, "bob's client mapped no arena: arena reads did not run"
        assert all(c[200:264] in arenas[0] for c in chunks)  # the check can see a chunk
        assert not any(c[200:264] in arenas[0] for c in secret)  # 64 payload bytes of each of alice's
    finally:
        bob.close()


def test_tenants_past_64_keep_their_own_usage_figures(tmp_path: Path) -> None:
    """66 tenants in the tokens file: the two that report last (past the aggregator's 64
    names) both run a replica named "r". Each keeps its own figures under its own name.
    Before, both were tenant "other" and shared one entry: each report of one read as a
    restart of the other (t64's 150 prompt tokens and t65's 5 summed to 255, 1 restart)."""
    tokens = {f"t{i:02d}": f"token-of-tenant-{i:02d}-0123456789" for i in range(66)}
    path = tmp_path / "tokens"
    path.write_text("".join(f"{tok} {name}\n" for name, tok in tokens.items()))
    path.chmod(0o600)
    node = start_server(tmp_path / "n", "--tokens-file", str(path), "--cpu-bytes", "66MiB", "--slot-bytes", "64KiB")
    try:
        with grpc.insecure_channel(node.address) as channel:
            call = channel.unary_unary(METHOD)

            def send(tenant: str, replica: str, prompt: int, seq: int) -> None:
                payload = json.loads(_report(replica, "m", prompt))
                payload.update(seq=seq, uptime_s=seq)
                call(json.dumps(payload).encode(), timeout=5,
                     metadata=(("authorization", f"Bearer {tokens[tenant]}"),))

            for i in range(64):
                send(f"t{i:02d}", f"r-{i}", 1, 1)
            send("t64", "r", 100, 1)
            send("t65", "r", 5, 1)
            send("t64", "r", 150, 2)
        mine = {r["tenant"]: (r["totals"]["prompt_tokens"], r["restarts"])
                for r in _replicas(node) if r["replica"] == "r"}
        assert mine == {"t64": (150, 0), "t65": (5, 0)}
    finally:
        assert node.stop() == 0, node.log


@pytest.mark.skipif(not have_redis(), reason="redis-server not installed")
def test_two_tenants_on_one_redis_keep_their_own_keys(tmp_path: Path) -> None:
    """With ``lower: redis`` one Redis holds both tenants' chunks, each under its own prefix
    (``<key_prefix>:<tenant>:v1:<hex>``): one key stored by both is two Redis keys, each read
    back (from Redis, the node's RAM emptied by a restart) as its own tenant's bytes, and one
    tenant's delete leaves the other's alone."""
    red = RedisServer().start()
    try:
        tokens = tmp_path / "tokens"
        tokens.write_text(f"{ALICE} alice\n{BOB} bob\n")
        tokens.chmod(0o600)
        node = start_server(tmp_path / "n", "--tokens-file", str(tokens), "--lower", "redis",
                            "--redis-url", red.url, "--cpu-bytes", "16MiB", "--slot-bytes", "64KiB")
        key = make_keys(1, seed=51)[0]
        mine, theirs = make_chunk(key, 20_000, 1), make_chunk(key, 20_000, 2)
        try:
            alice, bob = _tier(node, ALICE, False), _tier(node, BOB, False)
            try:
                assert alice.put([Entry(key, mine)]) == [True] and bob.put([Entry(key, theirs)]) == [True]
            finally:
                alice.close()
                bob.close()
            client = red.client()
            names = {f"kvtier:{t}:v1:{key.hex()}".encode(): c for t, c in (("alice", mine), ("bob", theirs))}
            end = time.monotonic() + 10
            while time.monotonic() < end and client.exists(*names) < 2:  # the writer is asynchronous
                time.sleep(0.05)
            assert sorted(client.keys("*")) == sorted(names)
            assert all(client.get(n) == c for n, c in names.items())
        finally:
            assert node.stop() == 0, node.log
        node = node.restart()  # RAM empty: reads go to Redis
        try:
            alice, bob = _tier(node, ALICE, False), _tier(node, BOB, False)
            try:
                assert alice.get([key]) == [mine] and bob.get([key]) == [theirs]
                assert bob.delete([key]) == 1
                assert alice.get([key]) == [mine] and red.client().exists(*names) == 1
            finally:
                alice.close()
                bob.close()
        finally:
            assert node.stop() == 0, node.log
    finally:
        red.stop()
        red.cleanup()
