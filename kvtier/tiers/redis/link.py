"""The redis tier's link to Redis: the redis-py client (one node or a cluster), its start-up,
the re-prober's ping, and one pipelined round trip per batch with every failure as a value.

:class:`RedisLink` owns the client, the per-node :class:`~kvtier.tiers.redis.health.NodeHealth`
and the per-label :class:`~kvtier.tiers.redis.health.FailureLog`; the tier
(``kvtier.tiers.redis``) owns key naming, TTL bookkeeping and what a reply means for a verb.
Routing is redis-py's: a single node gets one pipeline, a cluster one ClusterPipeline whose
batch redis-py splits per slot/node; commands whose master is down are not sent.

Failure: :meth:`RedisLink.single` and :meth:`RedisLink.cluster` never raise for the medium;
they return a :class:`~kvtier.tiers.redis.health.Failure` (counted, logged at most once per
label per 10 s, and the node marked down when the failure is at the connection level). Start-up
raises :class:`~kvtier.errors.TierUnavailableError` for bad credentials, a TLS mismatch or (unless
``lazy_connect``) an unreachable Redis.

Threads: any thread may call ``single``/``cluster``/``failed``; each thread keeps its own
ClusterPipeline. The re-prober callback runs on the NodeHealth thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.cluster import PipelineCommand, RedisCluster
from redis.exceptions import MovedError

from kvtier.config import RedisTierConfig
from kvtier.errors import TierUnavailableError
from kvtier.tiers.base import NODE_DOWN
from kvtier.tiers.redis.conn import RedisTarget, build_cluster, build_single, misconfiguration
from kvtier.tiers.redis.health import (
    F_CLUSTER_DOWN,
    F_MOVED,
    F_NODE_DOWN,
    MEDIUM_ERRORS,
    Failure,
    FailureLog,
    NodeHealth,
    classify,
    log,
)

__all__ = ["RedisLink"]

_DOWN = Failure(F_NODE_DOWN, NODE_DOWN, True)
# Pseudo node for the re-prober: "build the lazy cluster client" or, once built, "refresh the
# slot map" (after MOVED / CLUSTERDOWN), always off the caller's thread.
_CLUSTER = "<cluster>"


class RedisLink:
    """See the module docstring. ``closed`` reports whether the owning tier is closed (the
    re-prober then stops reconnecting)."""

    def __init__(self, config: RedisTierConfig, target: RedisTarget, name: str,
                 closed: Callable[[], bool]) -> None:
        self.config = config
        self.target = target
        self.name = name
        self._is_closed = closed
        self.failures = FailureLog(name)
        self.health = NodeHealth(config.backoff_s, config.backoff_max_s, name)
        self.health.start(self._ping_node)
        self._local = threading.local()  # per-thread ClusterPipeline
        self.client: redis.Redis | RedisCluster | None = None
        try:
            self._open()
        except TierUnavailableError:
            self.health.stop()
            raise

    def down_nodes(self) -> list[str]:
        """Nodes now skipped (``<cluster>``: no cluster client yet)."""
        down = self.health.down_nodes()
        return [n for n in down if n != _CLUSTER or self.client is None]

    def close(self) -> None:
        self.health.stop()
        client = self.client
        if client is not None:
            client.close()

    # --- start-up ----------------------------------------------------------------------------
    def _open(self) -> None:
        t = self.target
        if not t.cluster:
            self.client = build_single(self.config, t, self.health)
            try:
                self.client.ping()
            except MEDIUM_ERRORS as exc:
                self._startup_failed(exc, t.node_names[0])
                return
            self._refuse_cluster_node()
            return
        try:
            client = build_cluster(self.config, t, self.health)
        except MEDIUM_ERRORS as exc:
            self._startup_failed(exc, _CLUSTER)
            return
        self.client = client
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
            self.health.failed(name, f"at start: {err}")

    def _refuse_cluster_node(self) -> None:
        """A ``redis://`` URL naming a Redis Cluster node would serve only that node's slots
        and fail the rest with MOVED at every call: refuse it at start, naming the fix."""
        assert isinstance(self.client, redis.Redis)
        try:
            enabled = self.client.info("cluster").get("cluster_enabled")
        except MEDIUM_ERRORS as exc:  # INFO refused by an ACL, say: the ping answered, go on
            log.debug("redis tier %r: INFO cluster failed: %s", self.name, exc)
            return
        if enabled in (1, "1"):
            raise TierUnavailableError(
                f"redis tier {self.name!r}: {self.target.display} is a Redis Cluster node; use a "
                "redis+cluster:// (or rediss+cluster://) URL to reach the whole cluster")

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
        self.health.failed(node, f"at start: {exc}")

    def _ping_node(self, name: str) -> bool:
        """Re-prober callback (runs on the NodeHealth thread, connect gate open)."""
        if self._is_closed():
            return False
        if name == _CLUSTER:  # build the lazy client, or refresh a stale slot map
            if self.client is None:
                self.client = build_cluster(self.config, self.target, self.health)
            elif isinstance(self.client, RedisCluster):
                # keep the seeds' pools: other threads may be mid-pipeline on them
                self.client.nodes_manager.initialize(disconnect_startup_nodes_pools=False)
            return True
        client = self.client
        if isinstance(client, RedisCluster):
            # The slot map first: after a failover (or a pod back on a new address) the dead
            # master's slots live elsewhere, and nothing else would learn it, since commands
            # for a down node are never sent (so no MOVED comes back).
            client.nodes_manager.initialize(disconnect_startup_nodes_pools=False)
            if name not in {n.name for n in client.get_primaries()}:
                return True  # no longer a master: nothing routes to it any more
            node = client.get_node(node_name=name)
            return node is not None and bool(client.get_redis_connection(node).ping())
        return client is not None and bool(client.ping())

    # --- failure plumbing ----------------------------------------------------------------------
    def failed(self, f: Failure, n: int, exc: BaseException | str, node: str | None) -> None:
        self.failures.record(f.label, n, f"{exc}" + (f" [{node}]" if node else ""))
        if f.node_level and node is not None:
            self.health.failed(node, str(exc))  # idempotent while the node is down
        elif f.label in (F_CLUSTER_DOWN, F_MOVED) and isinstance(self.client, RedisCluster):
            # the slot map may be stale (resharding, failover, a cluster still forming):
            # have the re-prober thread refresh it, never the caller
            self.health.failed(_CLUSTER, f"slot map refresh after {f.label}", announce=False)

    def single(self, n: int, fn: Any) -> Any:
        """Run ``fn(client)`` against the one node; a Failure instead of any medium error."""
        node = self.target.node_names[0]
        client = self.client
        if client is None or self.health.is_down(node):
            self.failed(_DOWN, n, "node is down (backoff)", node)
            return _DOWN
        try:
            return fn(client)
        except MEDIUM_ERRORS as exc:
            f = classify(exc)
            self.failed(f, n, exc, node)
            return f

    def cluster(self, commands: Sequence[tuple[Any, ...]], stop_at_down: bool = False
                 ) -> list[Any]:
        """One ClusterPipeline round trip; per command its reply or a Failure. Commands whose
        master is down are not sent (``_DOWN``); with ``stop_at_down`` nothing after the first
        such command is sent either (prefix probes cannot extend past it)."""
        client = self.client
        results: list[Any] = [_DOWN] * len(commands)
        if not isinstance(client, RedisCluster):
            self.failed(_DOWN, len(commands), "cluster not connected yet", None)
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
                self.failed(results[i], 1, exc, None)
            if node and self.health.is_down(node):
                skipped += 1
                if stop_at_down:
                    break
                continue
            if node:
                live.append(i)
                nodes.append(node)
        if skipped:
            self.failed(_DOWN, skipped, "node is down (backoff)", None)
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
            self.failed(f, len(live), exc, None)  # the guarded connect marked the node
            for i in live:
                results[i] = f
            return results
        for i, node, reply in zip(live, nodes, replies):
            if isinstance(reply, BaseException):
                f = classify(reply)
                results[i] = f
                self.failed(f, 1, reply, node)
                if isinstance(reply, MovedError):  # patch the slot map, as redis-py does
                    client.nodes_manager.move_slot(reply)
            else:
                results[i] = reply
        return results
