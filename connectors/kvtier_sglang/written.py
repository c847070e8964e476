"""The page keys one backend stored, for ``clear()``: bounded, so memory stays flat on a
long-running server (SGLang's ``clear`` must not wipe pages other clients of a shared tier
stored, so the backend deletes only its own).

Threads: any (one lock). No SGLang import.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)

MAX_TRACKED = 1 << 20  # keys kept at most (~100 MB); beyond it clear() removes the first ones only


class WrittenKeys:
    def __init__(self, limit: int = MAX_TRACKED) -> None:
        self.limit = limit
        self._keys: set[bytes] = set()
        self._lock = threading.Lock()
        self._full = False

    def add(self, keys: Sequence[bytes]) -> int:
        """Track ``keys``; how many of them did not fit under the limit (untracked: clear()
        will not delete them; near the limit, keys tracked already count against the room
        left). The first time that happens it is logged."""
        with self._lock:
            room = max(self.limit - len(self._keys), 0)
            self._keys.update(keys[:room])
            if room < len(keys) and not self._full:
                self._full = True
                log.warning("kvtier_sglang: tracking %d pages for clear(); newer pages are not tracked",
                            self.limit)
        return max(len(keys) - room, 0)

    def take_all(self) -> list[bytes]:
        """Every tracked key, forgotten now (the caller deletes them)."""
        with self._lock:
            keys, self._keys = list(self._keys), set()
        return keys
