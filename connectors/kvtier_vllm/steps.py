"""Which recent steps saved what, on a worker: so that a step reported failed can be undone.

A step fails when a synchronous load in it fell short on some rank: vLLM may have let any of
the step's requests compute over the unrestored blocks (its prefix cache shares a loading
request's blocks at once; under tensor parallelism the all-reduce mixes every rank's blocks into
every rank's KV). The rank that saw the failure drops the step's saves before writing them and
reports the step (``failed``); every rank then gets the step back in ``purge_steps`` and deletes
what it saved in it (``purge``), after those writes and the store's write-behind are done.
Until that deletion ran, the keys it will delete are ``purging``: a capture must not skip them
as already stored (the step that recomputes them is captured before the deletion runs, and its
chunks would be lost once it did).

Threads: ``remember``/``take_failed``/``purge``/``first_purging`` on vLLM's forward thread; the
deletion itself runs on the saver thread (queued after the step's own save jobs).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.cache import PrefixCache
from kvtier.store import TieredStore

from .protocol import STEPS_REMEMBERED, SaveSpec
from .saver import Saver

log = logging.getLogger(__name__)

PURGE_FLUSH_S = 5.0  # a purge waits this long at most for the write-behind to drain


class SavedSteps:
    def __init__(self) -> None:
        self._saves: OrderedDict[int, list[SaveSpec]] = OrderedDict()
        self._failed: list[int] = []
        self._purging: Counter[bytes] = Counter()  # keys of queued purges (two may share a key)
        self._lock = threading.Lock()

    def remember(self, step: int, saves: list[SaveSpec]) -> None:
        if saves:
            self._saves[step] = saves
            while len(self._saves) > STEPS_REMEMBERED:
                self._saves.popitem(last=False)

    def failed(self, step: int) -> None:
        """This rank dropped ``step``'s saves; reported to the scheduler by ``take_failed``."""
        self._failed.append(step)
        self._saves.pop(step, None)  # nothing of it was written here

    def take_failed(self) -> list[int]:
        failed, self._failed = self._failed, []
        return failed

    def purge(self, step: int, saver: Saver, store: Callable[[], TieredStore],
              cache_for: Callable[[bytes], PrefixCache]) -> None:
        """Delete the chunks this rank saved in ``step``, once they are written. Deletes chunks
        of that step others stored before it too: a lost hit, never a wrong one."""
        saves = self._saves.pop(step, None)
        if not saves:
            return
        doomed: list[bytes] = []
        batches: list[tuple[list[bytes], list[bytes]]] = []  # (keys, their prefix) per save
        for spec in saves:
            tokens = np.frombuffer(spec.tokens, dtype="<u4")
            keys = cache_for(spec.salt).keys(tokens, full_chunks_only=not spec.partial)
            batches.append((keys[spec.start_chunk:spec.end_chunk], keys))
            doomed.extend(batches[-1][0])
        with self._lock:
            self._purging.update(doomed)

        def purge() -> None:
            target = store()
            target.flush(timeout_s=PURGE_FLUSH_S)  # else a cascade could put a chunk back
            n = 0
            try:  # with their prefix: a prefix-placed tier stored them on their group's nodes
                for keys, prefix in batches:
                    n += target.delete(keys, prefix)
            finally:
                with self._lock:
                    self._purging.subtract(doomed)
                    self._purging = +self._purging  # drop the keys at zero
            log.warning("kvtier: step %d failed on some rank: %d chunk(s) saved here deleted", step, n)

        saver.after_queued(purge)

    def first_purging(self, keys: Sequence[bytes]) -> int:
        """The index of the first of ``keys`` a queued purge will delete (``len(keys)``: none)."""
        if not self._purging:
            return len(keys)
        with self._lock:
            return next((i for i, k in enumerate(keys) if k in self._purging), len(keys))
