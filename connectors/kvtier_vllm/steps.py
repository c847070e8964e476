"""Which recent steps saved what, on a worker: so that a step reported failed can be undone.

A step fails when a synchronous load in it fell short on some rank: vLLM may have let any of
the step's requests compute over the unrestored blocks (its prefix cache shares a loading
request's blocks at once; under tensor parallelism the all-reduce mixes every rank's blocks into
every rank's KV). The rank that saw the failure drops the step's saves before writing them and
reports the step (``failed``); every rank then gets the step back in ``purge_steps`` and deletes
what it saved in it (``purge``), after those writes and the store's write-behind are done.

Threads: ``remember``/``take_failed``/``purge`` on vLLM's forward thread; the deletion itself runs
on the saver thread (queued after the step's own save jobs).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

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

        def purge() -> None:
            target = store()
            target.flush(timeout_s=PURGE_FLUSH_S)  # else a cascade could put a chunk back
            n = 0
            for spec in saves:
                tokens = np.frombuffer(spec.tokens, dtype="<u4")
                keys = cache_for(spec.salt).keys(tokens, full_chunks_only=not spec.partial)
                n += target.delete(keys[spec.start_chunk:spec.end_chunk])
            log.warning("kvtier: step %d failed on some rank: %d chunk(s) saved here deleted", step, n)

        saver.after_queued(purge)
