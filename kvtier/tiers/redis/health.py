"""Failure bookkeeping for the redis tier: error classification, per-reason counters with
rate-limited logging, and per-node reconnect backoff with a background re-prober.

Why a re-prober thread: once a node is known down, callers must not pay a connect attempt
(or a connect *timeout*, for a dead host) on every batch. A down node is skipped by every
verb (instant ``node_down`` misses) until the re-prober, not a caller, has pinged it back to
life; its pings are spaced ``backoff_s``, doubling to ``backoff_max_s``.

Threads: every method is safe to call from any thread; one lock guards all state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from redis import exceptions as rex

from kvtier.tiers.base import ERROR, NODE_DOWN, TIMEOUT

log = logging.getLogger("kvtier.tiers.redis")

# Failure labels (keys of RedisTier.failures). Read misses carry base.py miss reasons; the
# labels are finer so that operators can tell a full Redis from a dead one.
F_NODE_DOWN = "node_down"      # connection refused / reset, TLS failure, node in backoff
F_TIMEOUT = "timeout"          # connect or read exceeded timeout_s
F_OOM = "oom"                  # maxmemory reached with a noeviction policy
F_READONLY = "readonly"        # wrote to a replica (stale topology / failover)
F_CLUSTER_DOWN = "cluster_down"  # CLUSTERDOWN, TRYAGAIN, uncovered slot, no reachable node
F_MOVED = "moved"              # MOVED/ASK: slot migrated; the slot map is updated
F_AUTH = "auth"                # credentials rejected mid-run
F_TOO_LARGE = "too_large"      # value over max_value_bytes, refused before sending
F_ERROR = "error"              # any other error reply
FAILURE_LABELS = (F_NODE_DOWN, F_TIMEOUT, F_OOM, F_READONLY, F_CLUSTER_DOWN, F_MOVED, F_AUTH,
                  F_TOO_LARGE, F_ERROR)

# Exceptions the medium raises. OSError is included because the socket layer is the medium;
# redis-py wraps most of them, but a raw one must still become a miss, not a crash.
MEDIUM_ERRORS: tuple[type[BaseException], ...] = (rex.RedisError, rex.RedisClusterException,
                                                  OSError)


@dataclass(frozen=True, slots=True)
class Failure:
    label: str        # one of FAILURE_LABELS
    miss_reason: str  # a kvtier.tiers.base miss reason
    node_level: bool  # the node itself is unreachable: back it off


def classify(exc: BaseException) -> Failure:
    """Map one redis-py exception to a failure label and a miss reason.

    Order matters: redis-py's classes nest (ClusterDownError is a ResponseError,
    AuthenticationError a ConnectionError, MovedError an AskError)."""
    if isinstance(exc, rex.DataError):
        raise exc  # an encoding bug in this module, not a medium failure
    if isinstance(exc, (rex.AuthenticationError, rex.AuthorizationError, rex.NoPermissionError)):
        return Failure(F_AUTH, ERROR, False)
    if isinstance(exc, rex.TimeoutError):
        return Failure(F_TIMEOUT, TIMEOUT, True)
    if isinstance(exc, (rex.ConnectionError, OSError)):
        return Failure(F_NODE_DOWN, NODE_DOWN, True)
    if isinstance(exc, rex.OutOfMemoryError):
        return Failure(F_OOM, ERROR, False)
    if isinstance(exc, rex.ReadOnlyError):
        return Failure(F_READONLY, NODE_DOWN, False)
    if isinstance(exc, rex.AskError):  # MovedError too
        return Failure(F_MOVED, NODE_DOWN, False)
    if isinstance(exc, (rex.ClusterError, rex.TryAgainError, rex.RedisClusterException)):
        return Failure(F_CLUSTER_DOWN, NODE_DOWN, False)
    if isinstance(exc, rex.ResponseError):
        text = str(exc)
        if text.startswith("OOM") or "OOM command not allowed" in text:
            return Failure(F_OOM, ERROR, False)
        if text.startswith("READONLY"):
            return Failure(F_READONLY, NODE_DOWN, False)
        if text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
            return Failure(F_AUTH, ERROR, False)
    return Failure(F_ERROR, ERROR, False)


class FailureLog:
    """Counts failures per label and logs at most one warning per label per ``interval_s``
    (with the number of occurrences folded into it)."""

    def __init__(self, tier_name: str, interval_s: float = 10.0) -> None:
        self._tier = tier_name
        self._interval = interval_s
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {label: 0 for label in FAILURE_LABELS}
        self._last_log: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def record(self, label: str, n: int, detail: str) -> None:
        """Count ``n`` keys that failed with ``label``; maybe log one line about it."""
        now = time.monotonic()
        with self._lock:
            self._counts[label] = self._counts.get(label, 0) + n
            last = self._last_log.get(label)
            if last is not None and now - last < self._interval:
                self._quiet[label] = self._quiet.get(label, 0) + n
                return
            self._last_log[label] = now
            quiet = self._quiet.pop(label, 0)
        more = f" (+{quiet} keys since the last such line)" if quiet else ""
        log.warning("redis tier %r: %d keys failed with %s%s: %s", self._tier, n, label, more,
                    detail[:300])

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class NodeHealth:
    """Which nodes are down, and a daemon thread that pings them back.

    ``ping(name)`` is supplied by the tier; it runs on the re-prober thread with the connect
    gate open for that thread only (see :meth:`gate_open`), so the ping itself may connect.
    It returns True when the node answers and raises or returns False otherwise."""

    def __init__(self, backoff_s: float, backoff_max_s: float, tier_name: str) -> None:
        self._base = backoff_s
        self._max = max(backoff_max_s, backoff_s)
        self._tier = tier_name
        self._cond = threading.Condition()
        self._down: dict[str, tuple[float, float]] = {}  # name -> (next ping at, backoff)
        self._local = threading.local()
        self._ping: Callable[[str], bool] | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    # --- queries (hot path: one dict lookup under the lock) ----------------------------------
    def is_down(self, name: str) -> bool:
        with self._cond:
            return name in self._down

    def down_nodes(self) -> list[str]:
        with self._cond:
            return sorted(self._down)

    def gate_open(self, name: str) -> bool:
        """May a connection to ``name`` be attempted from this thread now?"""
        if getattr(self._local, "probing", False):
            return True
        with self._cond:
            return name not in self._down

    # --- transitions -------------------------------------------------------------------------
    def failed(self, name: str, why: str, announce: bool = True) -> None:
        """Mark ``name`` down (idempotent while it is down) and wake the re-prober;
        ``announce`` logs the transition as a warning."""
        with self._cond:
            if self._stopped or name in self._down:
                return
            self._down[name] = (time.monotonic() + self._base, self._base)
            self._ensure_thread()
            self._cond.notify_all()
        if not announce:
            return
        log.warning("redis tier %r: node %s is down (%s); skipping it, re-pinging every "
                    "%.2g-%.2g s", self._tier, name, why[:200], self._base, self._max)

    def start(self, ping: Callable[[str], bool]) -> None:
        self._ping = ping

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    # --- re-prober ---------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=f"kvtier-redis-reprobe-{self._tier}",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        self._local.probing = True
        while True:
            with self._cond:
                while not self._stopped:
                    now = time.monotonic()
                    due = [n for n, (at, _) in self._down.items() if at <= now]
                    if due:
                        break
                    if not self._down:
                        self._cond.wait()
                    else:
                        self._cond.wait(min(at for at, _ in self._down.values()) - now)
                if self._stopped:
                    return
            for name in due:
                self._reprobe(name)

    def _reprobe(self, name: str) -> None:
        ok = False
        try:
            ok = self._ping is not None and bool(self._ping(name))
        except MEDIUM_ERRORS as exc:
            log.debug("redis tier %r: node %s still down: %s", self._tier, name, exc)
        except Exception:  # the supervisor must outlive a library quirk
            # (redis-py's cluster discovery raises IndexError on a cluster whose slots are
            # not assigned yet); logged with its traceback, and the node stays down.
            log.warning("redis tier %r: re-probing %s failed unexpectedly", self._tier, name,
                        exc_info=True)
        with self._cond:
            if name not in self._down:
                return
            if ok:
                del self._down[name]
            else:
                backoff = min(self._down[name][1] * 2, self._max)
                self._down[name] = (time.monotonic() + backoff, backoff)
        if ok:
            log.info("redis tier %r: node %s is back", self._tier, name)
