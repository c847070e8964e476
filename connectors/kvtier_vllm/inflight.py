"""Chunks a worker is capturing or writing now, so that each is copied and written once.

Many requests of a batch carry the same prefix; when vLLM computes it for several of them
(prefills of one prefix in one step, or the same chunks computed again in a later step while
the first copy is still queued), every request's save would copy and write the same chunk.
``InflightChunks`` is the one set of chunk keys (namespace-salted, so tenants never share an
entry; partial chunks have keys of their own) whose capture has started and whose write has
not finished: the capture claims a chunk's key before it copies the chunk and skips chunks
another job holds; the saver releases the keys once the chunk was written to tier 0 or the job
was dropped (then a later request may capture the chunk again).

Threads: ``claim`` on the forward thread, ``release`` on the saver thread (or the forward
thread when a step's capture fails); one lock, held for set operations only.
Failure: none.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence


class InflightChunks:
    def __init__(self) -> None:
        self._keys: set[bytes] = set()
        self._lock = threading.Lock()

    def claim(self, keys: Sequence[bytes]) -> list[bool]:
        """Claim each key not held yet: True where this call claimed it (the caller now owns
        it and must ``release`` it), False where another job holds it (or ``keys`` repeats it)."""
        out: list[bool] = []
        with self._lock:
            held = self._keys
            for key in keys:
                fresh = key not in held
                if fresh:
                    held.add(key)
                out.append(fresh)
        return out

    def release(self, keys: Iterable[bytes]) -> None:
        """Give up keys this caller claimed (written, or dropped)."""
        with self._lock:
            self._keys.difference_update(keys)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._keys

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
