"""Copies between large buffers that let other threads run meanwhile.

``dst[:] = src`` on memoryviews holds the GIL for the whole memcpy (about 100 µs per MiB
here), so a server's connection threads (or a client's threads) that copy chunks into or
out of a shared segment take turns instead of copying at once. numpy's copy of a plain
uint8 array releases the GIL. Below :data:`SMALL` bytes the hand-off costs more than it
saves, and the plain copy is used. ``streaming=True`` (a destination not read again soon: a
cache's slot) copies with streaming stores (:func:`kvtier.strided.stream_copy`).
"""

from __future__ import annotations

import numpy as np

from kvtier.strided import stream_copy

SMALL = 64 << 10


def copy_into(dst: memoryview, src: memoryview | bytes | bytearray, *, streaming: bool = False) -> None:
    """Copy ``src`` into ``dst``, both C-contiguous and of the same byte length (``dst``
    writable). Raises ValueError naming both lengths when they differ."""
    n = memoryview(src).nbytes
    if dst.nbytes != n:
        raise ValueError(f"copy of {n} bytes into a buffer of {dst.nbytes}")
    if n < SMALL:
        dst.cast("B")[:] = memoryview(src).cast("B")
        return
    if streaming:
        stream_copy(dst, src)
        return
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
