"""The read buffers a restore stages chunks in: allocated and pre-faulted once, reused.

A restore reads encoded chunks from the store into page-aligned buffers (O_DIRECT reads go
straight into them) and copies each one into the KV tensors. Allocating those buffers per
restore costs a page fault per 4 KiB page on the first read into them (~2 us each on the VMs
we measure on: ~1 ms per 2 MiB chunk), so :class:`StagingRing` maps them once, touches every
page, and a connector keeps it for its life (:class:`~kvtier_hf.KVTierHF` builds one at
construction; :func:`kvtier_hf.restore.staging_for` sizes it).

The ring holds ``sets`` sets of ``batch`` buffers; read batch ``b`` goes into set
``b % sets``. With more sets than reads in flight the readers run ahead of the copy into the
KV tensors (up to ``sets - 1`` batches), so a slow copy (fresh KV pages faulting in) does not
leave the disk idle.

Threads: one restore at a time per ring (:attr:`lock`; a second caller waits). The buffers
are only touched by the restore holding the lock and by the reader threads it joins before
releasing it.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np

from kvtier.chunk import PAGE


class StagingRing:
    """``sets`` x ``batch`` page-aligned buffers of ``size`` bytes each, pre-faulted."""

    def __init__(self, size: int, batch: int, sets: int) -> None:
        if size < 1 or size % PAGE or batch < 1 or sets < 2:
            raise ValueError(f"staging ring needs page-multiple size, batch >= 1, sets >= 2; "
                             f"got size={size}, batch={batch}, sets={sets}")
        self.size, self.batch, self.sets = size, batch, sets
        # One anonymous mapping: page-aligned, and returned to the OS when the ring is dropped.
        self._map = mmap.mmap(-1, size * batch * sets)
        np.frombuffer(self._map, dtype=np.uint8)[:: mmap.PAGESIZE] = 0  # fault every page in now
        view = memoryview(self._map)
        self._sets = [[view[(s * batch + i) * size:(s * batch + i + 1) * size] for i in range(batch)]
                      for s in range(sets)]
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.size * self.batch * self.sets

    def buffers(self, batch_index: int) -> list[memoryview]:
        """The buffer set read batch ``batch_index`` goes into."""
        return self._sets[batch_index % self.sets]
