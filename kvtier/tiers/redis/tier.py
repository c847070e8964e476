"""The redis tier: Redis or Redis Cluster as a remote, shared tier (see docs/redis.md).

Values are the encoded chunks exactly as given (self-describing, so the store verifies them
on the way back); Redis keys are ``<key_prefix>:v1:<chunk key hex>``. Each verb is one
pipelined round trip: to the one node, or, for a cluster, one per master touched, the batch
being split per slot/node by redis-py's ClusterPipeline (no routing code here).

This module holds the verbs: key naming, TTL bookkeeping and what each reply means. Its
pieces: ``link`` (the client, start-up, one round trip per batch, failures as values),
``conn`` (URLs, client construction), ``health`` (failure labels, node health).

Failure (the remote-tier rule): refused / reset connections, timeouts, failover, MOVED/ASK,
CLUSTERDOWN, OOM, READONLY and auth errors never raise out of a verb. A read returns
``Miss(reason)``, a write ``False``; each failed key is counted per label in
:attr:`RedisTier.failures` and logged at most once per label per 10 s. A node that fails at
the connection level is skipped (instant ``node_down``) until a background thread has pinged
it back (backoff ``backoff_s`` doubling to ``backoff_max_s``). No call waits longer than one
``timeout_s`` per network wait: no retries, no reconnect loops in the caller's thread.

Start-up: one PING per node. Bad credentials or a TLS mismatch raise
:class:`~kvtier.errors.TierUnavailableError` with a clear message; an unreachable Redis
raises too unless ``lazy_connect`` is set, in which case the tier starts with its nodes down.

Threads: any thread may call any verb; redis-py's connection pools are thread-safe and each
call takes its own connection. Ownership: ``put`` hands the caller's buffers to the socket and
keeps nothing; ``get`` returns ``bytes`` the caller owns (redis-py's reply objects, no copy);
``get_into`` copies each reply once into the caller's buffer.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster

from kvtier.config import RedisTierConfig
from kvtier.errors import ConfigError
from kvtier.tiers.base import (
    ABSENT,
    ERROR,
    EXPIRED,
    TOO_LARGE,
    Entry,
    Miss,
    Probe,
    TierBase,
    TierUsage,
    check_keys,
)
from kvtier.tiers.redis.conn import as_value, resolve_target
from kvtier.tiers.redis.health import F_ERROR, F_TOO_LARGE, MEDIUM_ERRORS, Failure, classify
from kvtier.tiers.redis.link import RedisLink

_TTL_MEMORY = 65536     # keys whose TTL deadline is remembered (to label misses "expired")


class RedisTier(TierBase):
    def __init__(self, config: RedisTierConfig | None = None, name: str = "redis") -> None:
        super().__init__()
        cfg = config or RedisTierConfig()
        if "{" in cfg.key_prefix or "}" in cfg.key_prefix:
            raise ConfigError("redis.key_prefix: braces are Redis Cluster hash tags and would "
                              f"put every chunk in one slot: {cfg.key_prefix!r}")
        self.name = name
        self.config = cfg
        self.target = resolve_target(cfg)
        self._prefix = f"{cfg.key_prefix}:v1:".encode()
        self._deadlines: OrderedDict[bytes, float] = OrderedDict()
        # the client, node health and failure counts; raises TierUnavailableError at start-up
        self._link = RedisLink(cfg, self.target, name, lambda: self._closed)

    # --- public extras ---------------------------------------------------------------------
    @property
    def failures(self) -> dict[str, int]:
        """Failed keys per label since start (see kvtier.tiers.redis.health.FAILURE_LABELS)."""
        return self._link.failures.snapshot()

    def down_nodes(self) -> list[str]:
        """Nodes now skipped (``<cluster>``: no cluster client yet)."""
        return self._link.down_nodes()

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key a chunk key is stored under."""
        return self._prefix + key.hex().encode()

    # --- TTL bookkeeping (labels a miss "expired" when this process saw the key expire) ------
    def _note_deadlines(self, keys: Sequence[bytes], start: float) -> None:
        deadline = start + self.config.ttl_s
        with self._lock:
            for key in keys:
                self._deadlines[key] = deadline
                self._deadlines.move_to_end(key)
            while len(self._deadlines) > _TTL_MEMORY:
                self._deadlines.popitem(last=False)

    def _miss(self, key: bytes) -> Miss:
        if not self._deadlines:
            return Miss(ABSENT)
        with self._lock:
            deadline = self._deadlines.pop(key, None)
        return Miss(EXPIRED if deadline is not None and time.monotonic() >= deadline else ABSENT)

    # --- verbs ---------------------------------------------------------------------------------
    def _probe(self, keys: Sequence[bytes]) -> Probe:
        if not keys:
            return Probe(0)
        names = [self.redis_key(k) for k in keys]
        replies: list[Any]
        if self.target.cluster:
            replies = self._link.cluster([("EXISTS", n) for n in names], stop_at_down=True)
        else:
            def run(c: redis.Redis) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                for n in names:
                    pipe.exists(n)
                return pipe.execute(raise_on_error=False)
            got = self._link.single(len(names), run)
            replies = [got] * len(names) if isinstance(got, Failure) else got
        for i, reply in enumerate(replies):
            if isinstance(reply, Failure):
                return Probe(i, reply.miss_reason)
            if isinstance(reply, BaseException):
                f = classify(reply)
                self._link.failed(f, 1, reply, None)
                return Probe(i, f.miss_reason)
            if reply != 1:
                return Probe(i, self._miss(keys[i]).reason)
        return Probe(len(keys))

    def get(self, keys: Sequence[bytes]) -> list[bytes | Miss]:
        check_keys(keys)
        self._check_open()
        if not keys:
            return []
        names = [self.redis_key(k) for k in keys]
        # GETRANGE, not GET: a value under our key that is larger than any chunk we write (a
        # deployment sharing the key prefix, an older kvtier, a hostile client) is read only
        # up to one byte past the limit, never whole. A missing key reads as b"".
        limit = self.config.max_value_bytes
        replies: list[Any]
        if self.target.cluster:
            replies = self._link.cluster([("GETRANGE", n, 0, limit) for n in names])
        else:
            def run(c: redis.Redis) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                for n in names:
                    pipe.getrange(n, 0, limit)
                return pipe.execute(raise_on_error=False)
            got = self._link.single(len(names), run)
            replies = [got] * len(names) if isinstance(got, Failure) else got
        out: list[bytes | Miss] = []
        for key, reply in zip(keys, replies):
            if isinstance(reply, Failure):
                out.append(Miss(reply.miss_reason))
            elif isinstance(reply, BaseException):  # an error reply inside a single pipeline
                f = classify(reply)
                self._link.failed(f, 1, reply, None)
                out.append(Miss(f.miss_reason))
            elif not reply:
                out.append(self._miss(key))
            elif not isinstance(reply, bytes):
                # GETRANGE answers a bulk string; anything else (an integer, an array, a map)
                # is a peer that is not Redis or not well (a proxy, a look-alike): a miss, never
                # a TypeError out of the verb nor a list handed on as a chunk.
                self._link.failures.record(F_ERROR, 1, f"GETRANGE answered a {type(reply).__name__}, "
                                           "not a string")
                out.append(Miss(ERROR))
            elif len(reply) > limit:
                self._link.failures.record(F_TOO_LARGE, 1, f"a value over max_value_bytes={limit} "
                                           "under a chunk key, not read")
                out.append(Miss(TOO_LARGE))
            else:
                out.append(reply)
        return out

    def put(self, entries: Sequence[Entry]) -> list[bool]:
        check_keys([e.key for e in entries])
        self._check_open()
        limit, ttl = self.config.max_value_bytes, self.config.ttl_s
        ok = [False] * len(entries)
        send: list[int] = []
        for i, e in enumerate(entries):
            size = e.data.nbytes if isinstance(e.data, memoryview) else len(e.data)
            if size > limit:
                self._link.failures.record(F_TOO_LARGE, 1, f"{size}-byte value over "
                                      f"max_value_bytes={limit}, not sent")
            else:
                send.append(i)
        if not send:
            return ok
        start = time.monotonic()
        names = [self.redis_key(entries[i].key) for i in send]
        values = [as_value(entries[i].data) for i in send]
        replies: list[Any]
        if self.target.cluster:
            extra = ("EX", ttl) if ttl else ()
            replies = self._link.cluster([("SET", n, v, *extra) for n, v in zip(names, values)])
        elif ttl:
            def run(c: redis.Redis) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                for n, v in zip(names, values):
                    pipe.set(n, v, ex=ttl)
                return pipe.execute(raise_on_error=False)
            got = self._link.single(len(names), run)
            replies = [got] * len(names) if isinstance(got, Failure) else got
        else:  # one MSET: all-or-nothing, and the cheapest reply to parse
            got = self._link.single(len(names), lambda c: c.mset(dict(zip(names, values))))
            replies = [got] * len(names)
        stored: list[bytes] = []
        for i, reply in zip(send, replies):
            if isinstance(reply, BaseException):  # an error reply inside a single pipeline
                self._link.failed(classify(reply), 1, reply, None)
            elif not isinstance(reply, Failure) and reply:
                ok[i] = True
                stored.append(entries[i].key)
        if ttl and stored:
            self._note_deadlines(stored, start)
        return ok

    def delete(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        self._check_open()
        if not keys:
            return 0
        names = [self.redis_key(k) for k in keys]
        if self._deadlines:
            with self._lock:
                for k in keys:
                    self._deadlines.pop(k, None)
        if self.target.cluster:
            replies = self._link.cluster([("UNLINK", n) for n in names])
            return sum(r for r in replies if isinstance(r, int) and not isinstance(r, bool))
        got = self._link.single(len(names), lambda c: c.unlink(*names))
        return 0 if isinstance(got, Failure) else int(got)

    def usage(self) -> TierUsage:
        """Summed over reachable masters: ``used_memory_dataset`` (the data, without client
        buffers and allocator overhead), ``maxmemory`` (0 = unlimited) and DBSIZE. Redis owns
        eviction; these describe the whole Redis database, not only kvtier's keys."""
        self._check_open()
        client = self._link.client
        conns: list[tuple[str, redis.Redis]] = []
        if isinstance(client, RedisCluster):
            conns = [(n.name, client.get_redis_connection(n)) for n in client.get_primaries()]
        elif client is not None:
            conns = [(self.target.node_names[0], client)]
        used = cap = entries = 0
        for name, conn in conns:
            if self._link.health.is_down(name):
                continue
            try:
                pipe = conn.pipeline(transaction=False)
                pipe.info("memory")
                pipe.dbsize()
                info, size = pipe.execute()
            except MEDIUM_ERRORS as exc:
                self._link.failed(classify(exc), 0, exc, name)
                continue
            used += int(info.get("used_memory_dataset", info.get("used_memory", 0)))
            cap += int(info.get("maxmemory", 0))
            entries += int(size)
        return TierUsage(self.name, used, cap, entries)

    def _close(self) -> None:
        self._link.close()
