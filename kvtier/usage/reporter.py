"""The background sender: every ``usage.interval_s`` it sends the cumulative counters of one
engine component to every kvtier-server node in ``grpc.nodes``.

Never on the request path: connectors only bump :class:`~kvtier.usage.counters.UsageCounters`
under a lock; this thread encodes and sends. A node that is down, slow (each send has the
deadline ``min(grpc.timeout_s, interval_s)``) or refuses the report (an older server without
the RPC answers UNIMPLEMENTED) costs that one report: logged at debug, counted in
:attr:`UsageReporter.dropped`, retried with fresh counters at the next tick. Because counters are
cumulative, a dropped report loses nothing but freshness.

One reporter per (nodes, replica, source, model) per process, shared by reference count
(:func:`reporter_for`): two connectors of one model in one process feed the same counters, so
the server never sees two counter sets under one name. Nodes come from ``grpc.nodes``; a store
that finds its nodes by ``grpc.discovery`` has no fixed list and reports nothing (logged once).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

from kvtier.config import KVTierConfig
from kvtier.usage.counters import UsageCounters
from kvtier.usage.wire import encode_report, report_of

log = logging.getLogger(__name__)
METHOD = "/kvtier.v1.KVTier/ReportUsage"


def default_replica_id() -> str:
    """``host-pid``: stable for the life of this process, distinct across processes."""
    return f"{socket.gethostname()}-{os.getpid()}"


class UsageReporter:
    """Owns its channels and thread; :meth:`close` sends a last report and stops both."""

    def __init__(self, cfg: KVTierConfig, model: str, source: str, replica: str = "",
                 nodes: Sequence[str] | None = None) -> None:
        self.cfg = cfg
        self.model = model
        self.source = source
        self.replica = replica or cfg.usage.replica_id or default_replica_id()
        self.interval_s = cfg.usage.interval_s
        self.nodes = tuple(nodes if nodes is not None else cfg.grpc.nodes)
        self.counters = UsageCounters()
        self.sent = 0  # reports a node accepted
        self.dropped = 0  # reports a node did not take (down, slow, refused)
        # grpc is an optional extra: imported only when a store has a grpc tier to report to.
        import grpc

        from kvtier.tiers.remote.channel import channel_credentials, channel_options, read_token

        self._grpc = grpc
        self._seq = 0
        self._started = time.monotonic()  # the counters' start: uptime_s in reports
        token = read_token(cfg.grpc)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        creds = channel_credentials(cfg.grpc)
        opts = channel_options(cfg.grpc)
        self._channels = {a: (grpc.secure_channel(a, creds, opts) if creds is not None
                              else grpc.insecure_channel(a, opts)) for a in self.nodes}
        self._calls = {a: ch.unary_unary(METHOD) for a, ch in self._channels.items()}
        self._stop = threading.Event()
        self._send_lock = threading.Lock()
        self._refs = 1
        self._thread = threading.Thread(target=self._run, name=f"kvtier-usage-{source}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.send_now()

    def send_now(self, timeout_s: float | None = None) -> int:
        """Send the current counters to every node; returns how many nodes took them. One
        send at a time (the thread's tick, :meth:`close` and callers that want a report now)."""
        with self._send_lock:
            return self._send(timeout_s)

    def _send(self, timeout_s: float | None) -> int:
        self._seq += 1
        report = report_of(self.replica, self.source, self.model, self.interval_s,
                           time.monotonic() - self._started, self._seq, self.counters.snapshot(),
                           self.counters.top_prefixes())
        payload = encode_report(report)
        deadline = timeout_s if timeout_s is not None else min(self.cfg.grpc.timeout_s, self.interval_s)
        ok = 0
        for address, call in self._calls.items():
            try:
                call(payload, timeout=deadline, metadata=self._metadata)
            except self._grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, self._grpc.Call) else None
                self.dropped += 1
                log.debug("usage report to %s dropped: %s", address, code.name if code else exc)
            else:
                ok += 1
                self.sent += 1
        return ok

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.send_now(timeout_s=min(self.cfg.grpc.timeout_s, 1.0))  # the last counters
        for ch in self._channels.values():
            ch.close()


_shared: dict[tuple[tuple[str, ...], str, str, str], UsageReporter] = {}
_shared_lock = threading.Lock()


def reporter_for(cfg: KVTierConfig, model: str, source: str, replica: str = "") -> UsageReporter | None:
    """The process's reporter for this store, model and component, or None when there is
    nothing to report to (usage off, no grpc tier, or nodes by discovery). Pair every
    reporter returned with :func:`release`."""
    if not (cfg.usage.enabled and cfg.grpc.enabled):
        return None
    if not cfg.grpc.nodes:
        log.info("usage reports off: grpc.discovery gives no fixed node list")
        return None
    replica = replica or cfg.usage.replica_id or default_replica_id()
    key = (tuple(cfg.grpc.nodes), replica, source, model)
    with _shared_lock:
        rep = _shared.get(key)
        if rep is not None:
            rep._refs += 1
            return rep
        rep = _shared[key] = UsageReporter(cfg, model, source, replica)
        return rep


def release(rep: UsageReporter | None) -> None:
    """Drop one reference; the last one closes the reporter (a final report goes out)."""
    if rep is None:
        return
    with _shared_lock:
        rep._refs -= 1
        if rep._refs > 0:
            return
        for key, value in list(_shared.items()):
            if value is rep:
                del _shared[key]
    rep.close()
