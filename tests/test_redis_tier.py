"""The redis tier against real single-node redis-server processes (tests/redis_servers.py).

Covers: the contract suite, URL forms, the key layout, TTL expiry as a labelled miss, the
value-size bound (on puts, and on reads of values something else planted), OOM (maxmemory + noeviction), a READONLY replica, wrong credentials and TLS
mismatches at start (clear TierUnavailableError), a cluster node behind a plain URL, a
least-privilege ACL user, lazy start, a restart mid-run, a frozen
server (timeouts, no hang), and the rate-limited failure log.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import RedisTierConfig
from kvtier.errors import ConfigError, TierUnavailableError
from kvtier.tiers.base import ABSENT, EXPIRED, NODE_DOWN, TIMEOUT, TOO_LARGE, Entry, Miss
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis.conn import parse_url, resolve_target
from tests.contract import TierContract, chunk_for, key_of
from tests.redis_servers import (  # noqa: F401 (redis_tiers provides the "tiers" fixture)
    FAST,
    RedisClusterServers,
    RedisServer,
    free_port,
    have_redis,
    make_tls_files,
    redis_tiers,
    tier_for,
)

pytestmark = pytest.mark.skipif(not have_redis(), reason="redis-server/redis-cli not installed")

@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    yield s
    s.cleanup()


CONTRACT_MAXMEMORY = 2 << 20  # ~1 MiB of chunks above an empty Redis' own ~0.95 MiB


@pytest.fixture(scope="module")
def contract_redis() -> Iterator[RedisServer]:
    """The contract's own Redis: bounded and evicting like a cache, so the contract's capacity
    and eviction checks run (observed through the tier: usage() and misses)."""
    s = RedisServer(args=("--maxmemory", str(CONTRACT_MAXMEMORY),
                          "--maxmemory-policy", "allkeys-lru")).start()
    yield s
    s.cleanup()


class TestRedisContract(TierContract):
    reports_evicted = False   # Redis evicts on its own; a miss says "absent"
    exact_usage = False  # used_bytes is Redis' own memory figure
    exact_eviction = False  # approximate LRU may pick a chunk written this second
    capacity = CONTRACT_MAXMEMORY  # usage().capacity_bytes is maxmemory
    overfill = 4

    @pytest.fixture
    def make_tier(self, contract_redis: RedisServer,
                  tiers: Callable[..., RedisTier]) -> Callable[[int], RedisTier]:
        def factory(capacity_bytes: int) -> RedisTier:
            assert capacity_bytes == CONTRACT_MAXMEMORY
            contract_redis.client().flushdb()
            # A chunk that could not fit under maxmemory is refused before it is sent, as
            # docs/redis.md advises (sent, it would fail with OOM and its query buffer would
            # hold the memory until Redis' cron shrinks it).
            return tiers(contract_redis.url, max_value_bytes=CONTRACT_MAXMEMORY // 4)
        return factory


# --- configuration ----------------------------------------------------------------------------
def test_url_forms() -> None:
    t = parse_url("redis://127.0.0.1:7000/3")
    assert (t.cluster, t.tls, t.nodes, t.db) == (False, False, (("127.0.0.1", 7000),), 3)
    t = parse_url("rediss://al%40ice:p%3Ass@cache.example:6380")
    assert (t.tls, t.username, t.password, t.nodes) == (True, "al@ice", "p:ss",
                                                      (("cache.example", 6380),))
    t = parse_url("redis+cluster://h1:7000,h2,[::1]:7002")
    assert t.cluster and t.nodes == (("h1", 7000), ("h2", 6379), ("::1", 7002))
    assert parse_url("rediss+cluster://:pw@h:1").tls and parse_url("rediss+cluster://:pw@h:1").password == "pw"
    assert parse_url("redis://:secret@h:1/0").display == "redis://h:1/0"  # no password in logs
    for bad in ("http://h:1", "redis://h:1,h2:2", "redis://h:99999", "redis://h:1/x",
                "redis+cluster://h:1/2", "redis://h:1?ssl=1", "redis://"):
        with pytest.raises(ConfigError):
            parse_url(bad)


def test_config_credentials_override_url(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    cfg = RedisTierConfig(url="redis://u:url-pw@h:1", password_file=str(secret))
    assert (resolve_target(cfg).username, resolve_target(cfg).password) == ("u", "from-file")
    cfg = RedisTierConfig(url="redis://u:url-pw@h:1", username="v", password="explicit",
                          password_file=str(secret))
    assert (resolve_target(cfg).username, resolve_target(cfg).password) == ("v", "explicit")
    with pytest.raises(ConfigError):
        resolve_target(RedisTierConfig(password_file=str(tmp_path / "missing")))
    with pytest.raises(ConfigError):
        RedisTier(RedisTierConfig(key_prefix="kv{tag}"))


# --- layout, TTL, size bound -----------------------------------------------------------------
def test_key_layout_and_raw_value(server: RedisServer, tiers: Callable[..., RedisTier]) -> None:
    t = tiers(server.url, key_prefix="prod-a")
    key = key_of("layout")
    chunk = chunk_for(key)
    assert t.put([Entry(key, chunk)]) == [True]
    name = b"prod-a:v1:" + key.hex().encode()
    assert t.redis_key(key) == name
    raw = server.client()
    assert raw.get(name) == chunk  # the encoded chunk as given, nothing wrapped around it
    assert raw.ttl(name) == -1  # no TTL configured: no expiry
    other = tiers(server.url, key_prefix="prod-b")  # another deployment: separate keyspace
    assert other.get([key]) == [Miss(ABSENT)]
    assert sorted(raw.scan_iter(match="prod-a:v1:*")) == [name]


def test_ttl_expiry_is_a_labelled_miss(server: RedisServer, tiers: Callable[..., RedisTier]) -> None:
    t = tiers(server.url, ttl_s=1)
    keys = [key_of(f"ttl{i}") for i in range(3)]
    assert t.put([Entry(k, chunk_for(k)) for k in keys]) == [True] * 3
    assert 0 < server.client().ttl(t.redis_key(keys[0])) <= 1
    assert t.get(keys[:1]) == [chunk_for(keys[0])]
    time.sleep(1.3)
    assert t.get(keys[:2]) == [Miss(EXPIRED), Miss(EXPIRED)]
    probe = t.probe(keys[2:])
    assert (probe.hits, probe.reason) == (0, EXPIRED)
    # a process that did not write the keys cannot know: absent, never a wrong label
    assert tiers(server.url, ttl_s=1).get(keys[:1]) == [Miss(ABSENT)]


def test_too_large_refused_before_sending(server: RedisServer,
                                          tiers: Callable[..., RedisTier]) -> None:
    t = tiers(server.url, max_value_bytes=4096)
    small, big = key_of("small"), key_of("big")
    assert t.put([Entry(big, os.urandom(4097)), Entry(small, os.urandom(4096))]) == [False, True]
    assert t.failures["too_large"] == 1
    assert server.client().exists(t.redis_key(big)) == 0
    assert t.get([big]) == [Miss(ABSENT)]


def test_value_over_the_limit_is_not_read_whole(server: RedisServer,
                                                tiers: Callable[..., RedisTier]) -> None:
    """Something else wrote a value larger than any chunk under a chunk key (a deployment
    sharing the prefix, a hostile client): the read stops one byte past max_value_bytes."""
    t = tiers(server.url, max_value_bytes=4096)
    big, small = key_of("planted"), key_of("fine")
    server.client().set(t.redis_key(big), os.urandom(1 << 20))
    chunk = chunk_for(small)
    assert t.put([Entry(small, chunk)]) == [True]
    assert t.get([big, small]) == [Miss(TOO_LARGE), chunk]
    assert t.failures["too_large"] == 1
    out = bytearray(4096)
    assert t.get_into([big], [memoryview(out)]) == [Miss(TOO_LARGE)]


def test_cluster_node_behind_a_plain_url_is_refused_at_start(tiers: Callable[..., RedisTier]) -> None:
    c = RedisClusterServers().start()
    try:
        with pytest.raises(TierUnavailableError, match=r"redis\+cluster://"):
            tiers(c.nodes[0].url)
    finally:
        c.cleanup()


def test_least_privilege_acl_user(server: RedisServer, tiers: Callable[..., RedisTier]) -> None:
    """The commands docs/redis.md lists are all a tier needs (no CLIENT SETNAME, say)."""
    server.client().execute_command(
        "ACL", "SETUSER", "kvleast", "on", ">pw", "~kvtier:*", "+getrange", "+set", "+mset",
        "+exists", "+unlink", "+ping", "+info", "+dbsize")
    try:
        t = tiers(f"redis://kvleast:pw@{server.addr}/0")
        k = key_of("acl")
        assert t.put([Entry(k, chunk_for(k))]) == [True]
        assert t.get([k]) == [chunk_for(k)] and t.contains([k]) == 1 and t.delete([k]) == 1
        assert t.usage().used_bytes > 0
    finally:
        server.client().execute_command("ACL", "DELUSER", "kvleast")


# --- Redis refusing writes -------------------------------------------------------------------
def test_maxmemory_exhaustion_drops_writes(tiers: Callable[..., RedisTier]) -> None:
    s = RedisServer(args=("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")).start()
    try:
        t = tiers(s.url)
        keys = [key_of(f"oom{i}") for i in range(40)]
        results: list[bool] = []
        for k in keys:  # 40 x 256 KiB = 10 MiB into 3 MiB: Redis must start refusing
            results += t.put([Entry(k, os.urandom(256 << 10))])
        assert results[0] is True and results[-1] is False
        assert t.failures["oom"] >= results.count(False) > 0
        stored = [k for k, ok in zip(keys, results) if ok]
        assert all(not isinstance(v, Miss) for v in t.get(stored))  # reads keep working
        assert t.probe(stored).hits == len(stored)
        assert t.down_nodes() == []  # a full Redis is not a dead one
    finally:
        s.cleanup()


def test_readonly_replica_drops_writes(server: RedisServer,
                                       tiers: Callable[..., RedisTier]) -> None:
    replica = RedisServer(args=("--replicaof", "127.0.0.1", str(server.port))).start()
    try:
        t = tiers(replica.url)
        assert t.put([Entry(key_of("ro"), chunk_for(key_of("ro")))]) == [False]
        assert t.failures["readonly"] == 1
        assert t.put([Entry(key_of("ro2"), b"x" * 100)] * 1) == [False]
        ttl = tiers(replica.url, ttl_s=5)  # the pipelined SET EX path
        assert ttl.put([Entry(key_of("ro3"), b"y" * 100)]) == [False]
        assert ttl.failures["readonly"] == 1
    finally:
        replica.cleanup()


# --- start-up errors ---------------------------------------------------------------------------
def test_wrong_password_fails_fast() -> None:
    s = RedisServer(password="right").start()
    try:
        for url in (s.url.replace(":right@", ":wrong@"), s.url.replace(":right@", "")):
            t0 = time.monotonic()
            with pytest.raises(TierUnavailableError, match="credentials"):
                tier_for(url)
            assert time.monotonic() - t0 < 2.0
        t = tier_for(s.url.replace(":right@", ""), password="right")  # config password
        assert t.put([Entry(key_of("pw"), b"v" * 10)]) == [True]
        t.close()
    finally:
        s.cleanup()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def test_tls_round_trip_and_misconfigurations(server: RedisServer, tls_files: dict[str, str],
                                              tiers: Callable[..., RedisTier]) -> None:
    s = RedisServer(tls=tls_files).start()
    try:
        good = tiers(s.url, tls_ca=tls_files["ca"])
        key = key_of("tls")
        assert good.put([Entry(key, chunk_for(key))]) == [True]
        assert good.get([key]) == [chunk_for(key)]
        with pytest.raises(TierUnavailableError, match="TLS"):  # server cert not trusted
            tier_for(s.url)
        with pytest.raises(TierUnavailableError, match="rediss://"):  # plain TCP to a TLS port
            tier_for(s.url.replace("rediss://", "redis://"))
        t0 = time.monotonic()
        with pytest.raises(TierUnavailableError, match="TLS"):  # TLS to a plain-TCP port
            tier_for(server.url.replace("redis://", "rediss://"), tls_ca=tls_files["ca"])
        assert time.monotonic() - t0 < FAST["timeout_s"] + 1.5
        missing = str(Path(tls_files["ca"]).with_name("no-such-ca.pem"))
        for lazy in (False, True):  # a typo in a path is a config error, never "Redis is down"
            with pytest.raises(ConfigError, match="redis.tls_ca: cannot read"):
                tier_for(s.url, tls_ca=missing, lazy_connect=lazy)
    finally:
        s.cleanup()


def test_unreachable_at_start_then_lazy_recovery(tiers: Callable[..., RedisTier]) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with pytest.raises(TierUnavailableError, match="lazy_connect"):
        tier_for(url)
    t = tiers(url, lazy_connect=True)
    key = key_of("lazy")
    assert t.get([key]) == [Miss(NODE_DOWN)]
    assert t.put([Entry(key, b"v" * 64)]) == [False]
    assert t.probe([key]).reason == NODE_DOWN
    s = RedisServer(port=port).start()
    try:
        assert _eventually(lambda: t.put([Entry(key, b"v" * 64)]) == [True])
        assert t.get([key]) == [b"v" * 64]
        assert t.failures["node_down"] >= 3
    finally:
        s.cleanup()


# --- outages mid-run ---------------------------------------------------------------------------
def _eventually(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _load_loop(t: RedisTier, stop: threading.Event, log: list[tuple[float, Any]]) -> None:
    """put+get+probe in a loop; records (duration, result) per call, and any exception."""
    i = 0
    while not stop.is_set():
        key = key_of(f"loop{i % 50}")
        entry = Entry(key, chunk_for(key))
        for call in (lambda e=entry: t.put([e]), lambda k=key: t.get([k]),
                     lambda k=key: t.probe([k])):
            t0 = time.monotonic()
            try:
                result: Any = call()
            except Exception as exc:  # noqa: BLE001 - recorded; the test asserts there is none
                result = exc
            log.append((time.monotonic() - t0, result))
        i += 1


def test_restart_mid_run_is_misses_then_recovery(tiers: Callable[..., RedisTier]) -> None:
    s = RedisServer().start()
    try:
        t = tiers(s.url)
        stop, log = threading.Event(), []  # type: ignore[var-annotated]
        worker = threading.Thread(target=_load_loop, args=(t, stop, log))
        worker.start()
        time.sleep(0.3)
        s.kill()
        time.sleep(0.5)
        s.start()  # same port, empty (no persistence)
        assert _eventually(lambda: t.put([Entry(key_of("after"), b"a" * 99)]) == [True])
        time.sleep(0.3)
        stop.set()
        worker.join(10)
        assert not worker.is_alive()
        assert not [r for _, r in log if isinstance(r, Exception)]
        reasons = {r.reason for _, r in log if isinstance(r, Miss)}
        reasons |= {r[0].reason for _, r in log if isinstance(r, list) and r and isinstance(r[0], Miss)}
        assert NODE_DOWN in reasons and reasons <= {NODE_DOWN, TIMEOUT, ABSENT}
        assert max(d for d, _ in log) < FAST["timeout_s"] + 1.0
        assert t.get([key_of("after")]) == [b"a" * 99]
        assert t.down_nodes() == []
    finally:
        s.cleanup()


def test_frozen_server_times_out_without_hanging(tiers: Callable[..., RedisTier]) -> None:
    s = RedisServer().start()
    try:
        t = tiers(s.url, timeout_s=0.3)
        key = key_of("frozen")
        assert t.put([Entry(key, b"f" * 100)]) == [True]
        assert s.proc is not None
        os.kill(s.proc.pid, signal.SIGSTOP)  # accepts nothing, answers nothing
        try:
            t0 = time.monotonic()
            assert t.get([key]) == [Miss(TIMEOUT)]
            assert time.monotonic() - t0 < 0.3 + 0.7
            t0 = time.monotonic()
            assert t.get([key]) == [Miss(NODE_DOWN)]  # now skipped: no second wait
            assert t.put([Entry(key, b"g" * 100)]) == [False]
            assert time.monotonic() - t0 < 0.2
            assert t.failures["timeout"] == 1
        finally:
            os.kill(s.proc.pid, signal.SIGCONT)
        assert _eventually(lambda: t.get([key]) == [b"f" * 100])
    finally:
        s.cleanup()


def test_failure_log_is_rate_limited(tiers: Callable[..., RedisTier],
                                     caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    t = tiers(f"redis://127.0.0.1:{port}/0", lazy_connect=True)
    caplog.set_level(logging.WARNING, logger="kvtier.tiers.redis")
    caplog.clear()
    for i in range(200):
        t.get([key_of(i)])
    lines = [r for r in caplog.records if "failed with node_down" in r.getMessage()]
    assert len(lines) == 1  # 200 failing calls, one line (the next may come 10 s later)
    assert t.failures["node_down"] >= 200
