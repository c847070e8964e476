"""Which data path a node's chunk bytes take now, and when a failed one is tried again.

A :class:`~kvtier.tiers.remote.node.NodeClient` holds one slot. After a failed attach or a
broken path gRPC carries the bytes; the next attach is due ``RETRY_S`` later, doubling per
failure in a row up to ``RETRY_MAX_S``, and one caller only claims it. Once shut (the client
closed), nothing is installed again.

Threads: any; the slot's state changes under its own lock, which a caller may take while
holding the node's lock (never the other way round). Paths handed out by :meth:`take` and
:meth:`shut` are the caller's to close.
"""

from __future__ import annotations

import threading
import time

from kvtier.tiers.remote.data_path import SocketDataPath

RETRY_S = 5.0  # after a data-path failure on a live node, gRPC carries bytes this long,
RETRY_MAX_S = 120.0  # doubling per failure in a row up to this


class DataSlot:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: SocketDataPath | None = None  # the fast path, once Info advertised one
        self.failures = 0  # failed attaches or broken paths in a row (the retry backoff)
        self._retry_at = 0.0  # when a failed data path is tried again (0: not due)
        self._shut = False

    def take(self) -> SocketDataPath | None:
        """Remove the current path (None if none); the caller closes it."""
        with self._lock:
            data, self.current = self.current, None
        return data

    def shut(self) -> SocketDataPath | None:
        """Final: :meth:`take`, and :meth:`install` refuses from now on."""
        with self._lock:
            self._shut = True
            data, self.current = self.current, None
        return data

    def install(self, data: SocketDataPath) -> bool:
        """Make ``data`` (handshaken) current, closing the one it replaces (a concurrent
        attach's); False, and ``data`` closed, once shut."""
        with self._lock:
            installed = not self._shut
            if installed:
                old, self.current = self.current, data
                self.failures = 0
        if not installed:
            data.close()
            return False
        if old is not None:
            old.close()
        return True

    def retry_later(self) -> float:
        """Count one more failure and schedule the next attach; returns the wait in seconds."""
        with self._lock:
            self.failures += 1
            wait = min(RETRY_S * 2 ** (self.failures - 1), RETRY_MAX_S)
            self._retry_at = time.monotonic() + wait
        return wait

    def claim_retry(self) -> bool:
        """True for the one caller that is to attach now: no current path and the retry due.
        Concurrent callers get False (they use gRPC meanwhile)."""
        with self._lock:
            due = (self.current is None and not self._shut and self._retry_at > 0
                   and time.monotonic() >= self._retry_at)
            if due:
                self._retry_at = 0.0
        return due

    def failed(self, data: SocketDataPath) -> bool:
        """``data`` broke: closed, and dropped if still current (True: schedule a retry). One
        that mark_down or a newer attach already replaced stays as it is."""
        with self._lock:
            current = self.current is data
            if current:
                self.current = None
        data.close()
        return current
