"""Memory for restored K/V tensors, recycled once transformers lets go of it.

A restore writes every byte of the K/V tensors it hands to the cache, and those tensors live
only until the first forward over the rest of the prompt (``DynamicCache`` concatenates the
new tokens into tensors of its own, dropping the restored ones). Fresh memory for each
restore costs a page fault per page it writes, and on the VMs we measure on far more than
that: a page the guest never touched since boot is also faulted in by the host, so the same
2 x 52 MB transposed copy took 19-24 ms into recycled pages and 56-141 ms into fresh ones, run
to run (``kvtier demo``: restores at 0.6 GB/s against 1.3-1.9 from the same disk).

:class:`KVPool` hands out tensors over slabs it keeps: a tensor's slab goes back to the pool
when the last reference to the tensor's memory dies (a ``weakref.finalize`` on the numpy
array the tensor wraps: torch's storage holds that array, and every view holds the storage),
so a slab is never written while any tensor or view of it is alive. Slabs are ``np.empty``
arrays, which numpy advises as transparent huge pages from 4 MiB up (see
:func:`kvtier_hf.kv.fresh_kv`).

Bound: at most :attr:`KVPool.keep` slabs and :attr:`KVPool.keep_bytes` bytes wait in the pool
(a restore takes two slabs, K and V); past either the longest-waiting ones are dropped, their
memory returned to the OS. So a connector never holds more than ``keep_bytes`` of idle host
memory (1 GiB by default: the demo's restores are ~25 MB a tensor; a restore far larger than
that is served fresh memory each time, as before the pool). A slab serves a request of
at most its size and at least half of it, so a short restore does not pin a long one's memory.

Threads: any thread may take; a slab comes back on whichever thread drops the last reference
(a lock guards the free list; a slab given back while another thread holds it is dropped,
never waited for: a finalizer may run inside a garbage collection under that very lock).
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np
import torch

KEEP_SLABS = 4  # two restores' K and V
KEEP_BYTES = 1 << 30  # idle memory a pool may hold


class KVPool:
    """Recycled K/V memory (see the module docstring)."""

    def __init__(self, keep: int = KEEP_SLABS, keep_bytes: int = KEEP_BYTES) -> None:
        if keep < 0 or keep_bytes < 0:
            raise ValueError(f"keep and keep_bytes must be >= 0, got {keep} and {keep_bytes}")
        self.keep, self.keep_bytes = keep, keep_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.reused = 0  # tensors served from a recycled slab (for tests and stats)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``, over a recycled
        slab where one fits, else over a new one."""
        nbytes = math.prod(shape) * dtype.itemsize
        slab = self._take(nbytes)
        view = slab[:nbytes]  # its own array object: its death gives the slab back
        weakref.finalize(view, self._give_back, slab).atexit = False  # nothing to give back at exit
        return torch.from_numpy(view).view(dtype).view(shape)

    @property
    def free_slabs(self) -> int:
        with self._lock:
            return len(self._free)

    def _take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, s in enumerate(self._free) if nbytes <= s.nbytes <= 2 * max(nbytes, 1)]
            if fits:
                self.reused += 1
                return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        return np.empty(max(nbytes, 1), dtype=np.uint8)

    def _give_back(self, slab: np.ndarray) -> None:
        # A finalizer runs wherever the last reference dies, which may be a garbage collection
        # inside _take on this very thread, with the lock held: never wait for it. A slab that
        # finds the lock taken is dropped (its memory goes back to the OS; only reuse is lost).
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._free.append(slab)
            held = sum(s.nbytes for s in self._free)
            while self._free and (len(self._free) > self.keep or held > self.keep_bytes):
                held -= self._free.pop(0).nbytes
        finally:
            self._lock.release()
