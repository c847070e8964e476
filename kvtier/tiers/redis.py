"""The redis tier: Redis or Redis Cluster as a remote, shared tier (see docs/redis.md).

Values are the encoded chunks exactly as given (self-describing, so the store verifies them
on the way back); Redis keys are ``<key_prefix>:v1:<chunk key hex>``. Each verb is one
pipelined round trip: to the one node, or, for a cluster, one per master touched, the batch
being split per slot/node by redis-py's ClusterPipeline (no routing code here).

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

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import redis
from redis.cluster import PipelineCommand, RedisCluster
from redis.exceptions import MovedError

from kvtier.config import RedisTierConfig
from kvtier.errors import ConfigError, TierUnavailableError
from kvtier.tiers.base import (
    ABSENT,
    EXPIRED,
    NODE_DOWN,
    Entry,
    Miss,
    Probe,
    TierBase,
    TierUsage,
    check_keys,
)
from kvtier.tiers.redis_conn import (
    as_value,
    build_cluster,
    build_single,
    misconfiguration,
    resolve_target,
)
from kvtier.tiers.redis_health import (
    F_CLUSTER_DOWN,
    F_MOVED,
    F_NODE_DOWN,
    F_TOO_LARGE,
    MEDIUM_ERRORS,
    Failure,
    FailureLog,
    NodeHealth,
    classify,
    log,
)

_DOWN = Failure(F_NODE_DOWN, NODE_DOWN, True)
# Pseudo node for the re-prober: "build the lazy cluster client" or, once built, "refresh the
# slot map" (after MOVED / CLUSTERDOWN), always off the caller's thread.
_CLUSTER = "<cluster>"
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
        self._failures = FailureLog(name)
        self._health = NodeHealth(cfg.backoff_s, cfg.backoff_max_s, name)
        self._health.start(self._ping_node)
        self._deadlines: OrderedDict[bytes, float] = OrderedDict()
        self._local = threading.local()  # per-thread ClusterPipeline
        self._client: redis.Redis | RedisCluster | None = None
        try:
            self._open()
        except TierUnavailableError:
            self._health.stop()
            raise

    # --- public extras ---------------------------------------------------------------------
    @property
    def failures(self) -> dict[str, int]:
        """Failed keys per label since start (see redis_health.FAILURE_LABELS)."""
        return self._failures.snapshot()

    def down_nodes(self) -> list[str]:
        """Nodes now skipped (``<cluster>``: no cluster client yet)."""
        down = self._health.down_nodes()
        return [n for n in down if n != _CLUSTER or self._client is None]

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key a chunk key is stored under."""
        return self._prefix + key.hex().encode()

    # --- start-up ----------------------------------------------------------------------------
    def _open(self) -> None:
        t = self.target
        if not t.cluster:
            self._client = build_single(self.config, t, self._health)
            try:
                self._client.ping()
            except MEDIUM_ERRORS as exc:
                self._startup_failed(exc, t.node_names[0])
            return
        try:
            client = build_cluster(self.config, t, self._health)
        except MEDIUM_ERRORS as exc:
            self._startup_failed(exc, _CLUSTER)
            return
        self._client = client
        primaries = client.get_primaries()
        errors: list[tuple[str, BaseException]] = []
        for node in primaries:
            try:
                client.get_redis_connection(node).ping()
            except MEDIUM_ERRORS as exc:
                self._refuse_if_misconfigured(exc)
                errors.append((node.name, exc))
        if errors and len(errors) == len(primaries):
            self._startup_failed(errors[0][1], errors[0][0])
        for name, err in errors:  # some masters down: serve the others, re-ping these
            log.warning("redis tier %r: master %s unreachable at start: %s", self.name, name, err)
            self._health.failed(name, f"at start: {err}")

    def _refuse_if_misconfigured(self, exc: BaseException) -> None:
        err = misconfiguration(exc, self.target, self.name)
        if err is not None:
            raise err from exc

    def _startup_failed(self, exc: BaseException, node: str) -> None:
        self._refuse_if_misconfigured(exc)
        t = self.target
        hint = "" if t.tls else " (if that port speaks TLS, use rediss://)"
        if not self.config.lazy_connect:
            raise TierUnavailableError(
                f"redis tier {self.name!r}: cannot reach {t.display} within "
                f"{self.config.timeout_s} s: {exc}{hint}; start Redis first or set "
                "redis.lazy_connect=true to start with the tier down") from exc
        log.warning("redis tier %r: %s is unreachable at start (%s); starting with it down "
                    "(lazy_connect)", self.name, t.display, exc)
        self._health.failed(node, f"at start: {exc}")

    def _ping_node(self, name: str) -> bool:
        """Re-prober callback (runs on the NodeHealth thread, connect gate open)."""
        if self._closed:
            return False
        if name == _CLUSTER:  # build the lazy client, or refresh a stale slot map
            if self._client is None:
                self._client = build_cluster(self.config, self.target, self._health)
            elif isinstance(self._client, RedisCluster):
                # keep the seeds' pools: other threads may be mid-pipeline on them
                self._client.nodes_manager.initialize(disconnect_startup_nodes_pools=False)
            return True
        client = self._client
        if isinstance(client, RedisCluster):
            node = client.get_node(node_name=name)
            if node is None:  # left the topology: nothing routes to it any more
                return True
            return bool(client.get_redis_connection(node).ping())
        return client is not None and bool(client.ping())

    # --- failure plumbing ----------------------------------------------------------------------
    def _failed(self, f: Failure, n: int, exc: BaseException | str, node: str | None) -> None:
        self._failures.record(f.label, n, f"{exc}" + (f" [{node}]" if node else ""))
        if f.node_level and node is not None:
            self._health.failed(node, str(exc))  # idempotent while the node is down
        elif f.label in (F_CLUSTER_DOWN, F_MOVED) and isinstance(self._client, RedisCluster):
            # the slot map may be stale (resharding, failover, a cluster still forming):
            # have the re-prober thread refresh it, never the caller
            self._health.failed(_CLUSTER, f"slot map refresh after {f.label}", announce=False)

    def _single(self, n: int, fn: Any) -> Any:
        """Run ``fn(client)`` against the one node; a Failure instead of any medium error."""
        node = self.target.node_names[0]
        client = self._client
        if client is None or self._health.is_down(node):
            self._failed(_DOWN, n, "node is down (backoff)", node)
            return _DOWN
        try:
            return fn(client)
        except MEDIUM_ERRORS as exc:
            f = classify(exc)
            self._failed(f, n, exc, node)
            return f

    def _cluster(self, commands: Sequence[tuple[Any, ...]], stop_at_down: bool = False
                 ) -> list[Any]:
        """One ClusterPipeline round trip; per command its reply or a Failure. Commands whose
        master is down are not sent (``_DOWN``); with ``stop_at_down`` nothing after the first
        such command is sent either (prefix probes cannot extend past it)."""
        client = self._client
        results: list[Any] = [_DOWN] * len(commands)
        if not isinstance(client, RedisCluster):
            self._failed(_DOWN, len(commands), "cluster not connected yet", None)
            return results
        live: list[int] = []
        nodes: list[str] = []
        skipped = 0
        for i, cmd in enumerate(commands):
            try:
                node = client.get_node_from_key(cmd[1]).name
            except MEDIUM_ERRORS as exc:  # SlotNotCoveredError
                node = ""
                results[i] = classify(exc)
                self._failed(results[i], 1, exc, None)
            if node and self._health.is_down(node):
                skipped += 1
                if stop_at_down:
                    break
                continue
            if node:
                live.append(i)
                nodes.append(node)
        if skipped:
            self._failed(_DOWN, skipped, "node is down (backoff)", None)
        if not live:
            return results
        pipe = getattr(self._local, "pipe", None)
        if pipe is None:
            pipe = self._local.pipe = client.pipeline(transaction=False)
        stack = [PipelineCommand(commands[i], {}, j) for j, i in enumerate(live)]
        try:
            replies = pipe.send_cluster_commands(stack, raise_on_error=False,
                                                 allow_redirections=False)
        except MEDIUM_ERRORS as exc:  # e.g. no connection to a master: the whole batch
            f = classify(exc)
            self._failed(f, len(live), exc, None)  # the guarded connect marked the node
            for i in live:
                results[i] = f
            return results
        for i, node, reply in zip(live, nodes, replies):
            if isinstance(reply, BaseException):
                f = classify(reply)
                results[i] = f
                self._failed(f, 1, reply, node)
                if isinstance(reply, MovedError):  # patch the slot map, as redis-py does
                    client.nodes_manager.move_slot(reply)
            else:
                results[i] = reply
        return results

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
            replies = self._cluster([("EXISTS", n) for n in names], stop_at_down=True)
        else:
            def run(c: redis.Redis) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                for n in names:
                    pipe.exists(n)
                return pipe.execute(raise_on_error=False)
            got = self._single(len(names), run)
            replies = [got] * len(names) if isinstance(got, Failure) else got
        for i, reply in enumerate(replies):
            if isinstance(reply, Failure):
                return Probe(i, reply.miss_reason)
            if isinstance(reply, BaseException):
                f = classify(reply)
                self._failed(f, 1, reply, None)
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
        replies: list[Any]
        if self.target.cluster:
            replies = self._cluster([("GET", n) for n in names])
        else:
            got = self._single(len(names), lambda c: c.mget(names))
            replies = [got] * len(names) if isinstance(got, Failure) else got
        out: list[bytes | Miss] = []
        for key, reply in zip(keys, replies):
            if reply is None:
                out.append(self._miss(key))
            elif isinstance(reply, Failure):
                out.append(Miss(reply.miss_reason))
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
                self._failures.record(F_TOO_LARGE, 1, f"{size}-byte value over "
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
            replies = self._cluster([("SET", n, v, *extra) for n, v in zip(names, values)])
        elif ttl:
            def run(c: redis.Redis) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                for n, v in zip(names, values):
                    pipe.set(n, v, ex=ttl)
                return pipe.execute(raise_on_error=False)
            got = self._single(len(names), run)
            replies = [got] * len(names) if isinstance(got, Failure) else got
        else:  # one MSET: all-or-nothing, and the cheapest reply to parse
            got = self._single(len(names), lambda c: c.mset(dict(zip(names, values))))
            replies = [got] * len(names)
        stored: list[bytes] = []
        for i, reply in zip(send, replies):
            if isinstance(reply, BaseException):  # an error reply inside a single pipeline
                self._failed(classify(reply), 1, reply, None)
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
            replies = self._cluster([("UNLINK", n) for n in names])
            return sum(r for r in replies if isinstance(r, int) and not isinstance(r, bool))
        got = self._single(len(names), lambda c: c.unlink(*names))
        return 0 if isinstance(got, Failure) else int(got)

    def usage(self) -> TierUsage:
        """Summed over reachable masters: ``used_memory_dataset`` (the data, without client
        buffers and allocator overhead), ``maxmemory`` (0 = unlimited) and DBSIZE. Redis owns
        eviction; these describe the whole Redis database, not only kvtier's keys."""
        self._check_open()
        client = self._client
        conns: list[tuple[str, redis.Redis]] = []
        if isinstance(client, RedisCluster):
            conns = [(n.name, client.get_redis_connection(n)) for n in client.get_primaries()]
        elif client is not None:
            conns = [(self.target.node_names[0], client)]
        used = cap = entries = 0
        for name, conn in conns:
            if self._health.is_down(name):
                continue
            try:
                pipe = conn.pipeline(transaction=False)
                pipe.info("memory")
                pipe.dbsize()
                info, size = pipe.execute()
            except MEDIUM_ERRORS as exc:
                self._failed(classify(exc), 0, exc, name)
                continue
            used += int(info.get("used_memory_dataset", info.get("used_memory", 0)))
            cap += int(info.get("maxmemory", 0))
            entries += int(size)
        return TierUsage(self.name, used, cap, entries)

    def _close(self) -> None:
        self._health.stop()
        client = self._client
        if client is not None:
            client.close()
