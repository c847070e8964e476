"""Copies between a strided region of a big buffer (one K/V page of an engine's pool) and a
contiguous one (a chunk's payload), described once per page shape as a list of runs.

A page viewed in kvtier's canonical order is, in most engine layouts, not contiguous: it is
``len(offsets)`` runs of ``run`` bytes each, at ``offsets`` from the page's first byte
(:func:`runs_of` merges the trailing dimensions that are contiguous into one run). Every page
of a pool has the same runs, so callers compute them once per shape and reuse them.

:func:`gather_into` (page -> payload) and :func:`scatter_from` (payload -> page) copy with
the optional C loop ``kvtier._stream``: streaming stores that write destination lines without
first reading them (a stored page is not read again soon; a restored one is next read by a DMA
engine or another thread), and for a gather the payload's xxh3 taken on the way, from an
L2-sized bounce buffer (what is hashed is what is stored). A destination read again at once
(a reused buffer a socket or file write takes next) is better left to torch or numpy: a C
gather there (streaming, or ordinary stores with the hash taken from cache) measured 10-15 %
slower than torch's copy and a separate hash (bench/e2e_sglang.py, 2026-12-07). Where the C
loop is not built, numpy's strided copy and a separate xxh3 pass do the same. Both release
the GIL while copying.

Failure: a ValueError naming the mismatch (sizes, a run outside its buffer) before anything
is copied. Threads: any; concurrent calls must not write the same bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

log = logging.getLogger(__name__)


def _load() -> Any:
    """kvtier._stream with XXH3 bound and checked against xxhash; None where it is not built
    or disagrees."""
    try:
        from kvtier import _stream
    except ImportError:
        return None
    if not _stream.bind_hash(xxhash._xxhash.__file__):  # type: ignore[attr-defined]
        log.info("kvtier._stream: XXH3_64bits not found in the xxhash package; not used")
        return None
    for n in (0, 1, 100, 240, 241, 4096, 1 << 20, (1 << 20) + 12345):  # short, mid, long, > bounce
        data = (bytes(range(256)) * (n // 256 + 1))[:n]
        out = bytearray(n)
        offsets = np.zeros(1 if n else 0, np.int64).data
        got = _stream.gather(out, data, 0, offsets, max(n, 1), True)
        if got != xxhash.xxh3_64_intdigest(data) or out != data:
            log.warning("kvtier._stream's gather disagrees with numpy and xxhash: not used")
            return None
    return _stream


_STREAM = _load()


def accelerated() -> bool:
    """Whether the C loop (streaming stores) does the copies."""
    return _STREAM is not None


@dataclass(frozen=True)
class Runs:
    """``offsets`` (int64, bytes from the region's first byte, in copy order) of runs of
    ``run`` bytes; ``shape``/``strides`` (bytes) index the runs as numpy would."""

    run: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offsets: np.ndarray = field(compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return len(self.offsets) * self.run

    @property
    def span(self) -> int:
        """Bytes from the first byte to one past the last byte a run touches."""
        return int(self.offsets.max()) + self.run if len(self.offsets) else 0


def runs_of(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> Runs:
    """The runs of a strided array of ``shape`` with ``strides`` (in bytes, non-negative) of
    ``itemsize``-byte items, in C order: its trailing dimensions that lie contiguously are one
    run."""
    if len(shape) != len(strides):
        raise ValueError(f"shape {shape} and strides {strides} differ in length")
    if any(s < 0 for s in strides) or itemsize <= 0:
        raise ValueError(f"strides {strides} must be non-negative and itemsize {itemsize} positive")
    run, dims = itemsize, len(shape)
    while dims and (shape[dims - 1] == 1 or strides[dims - 1] == run):
        run *= shape[dims - 1]
        dims -= 1
    outer, steps = tuple(shape[:dims]), tuple(strides[:dims])
    offsets = np.zeros(1, np.int64)
    for n, step in zip(outer, steps):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * step).reshape(-1)
    return Runs(run=run, shape=outer, strides=steps, offsets=np.ascontiguousarray(offsets))


def _strided(buf: Any, start: int, runs: Runs, writable: bool) -> np.ndarray:
    """numpy's view of the runs in ``buf`` (the fallback's reference copy path)."""
    flat = np.frombuffer(buf, np.uint8)
    if not writable:
        flat = flat.view()
        flat.flags.writeable = False
    if start < 0 or start + runs.span > flat.nbytes:
        raise ValueError(f"runs spanning {runs.span} bytes at {start} leave a {flat.nbytes}-byte buffer")
    return np.lib.stride_tricks.as_strided(flat[start:], shape=runs.shape + (runs.run,),
                                           strides=runs.strides + (1,), writeable=writable)


def gather_into(dst: Any, src: Any, start: int, runs: Runs) -> int:
    """Copy the runs of ``src`` (a buffer; the region begins ``start`` bytes in) into ``dst``
    (a writable contiguous buffer of exactly ``runs.nbytes``, best one not read again soon:
    a cache's slot); returns the xxh3_64 of the bytes written."""
    out = np.frombuffer(dst, np.uint8)
    if out.nbytes != runs.nbytes:
        raise ValueError(f"dst is {out.nbytes} bytes; the runs are {runs.nbytes}")
    if _STREAM is not None:
        return int(_STREAM.gather(out, src, start, runs.offsets, runs.run, True))
    np.copyto(out.reshape(runs.shape + (runs.run,)), _strided(src, start, runs, writable=False))
    return xxhash.xxh3_64_intdigest(out.data)


_ONE_RUN = np.zeros(1, np.int64)


def stream_copy(dst: Any, src: Any) -> None:
    """Copy the contiguous buffer ``src`` into ``dst`` (writable, contiguous, the same length;
    ValueError otherwise) with streaming stores: for a destination not read again soon (a
    cache's slot). numpy's copy where the C loop is not built."""
    out, data = np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8)
    if out.nbytes != data.nbytes:
        raise ValueError(f"copy of {data.nbytes} bytes into a buffer of {out.nbytes}")
    if _STREAM is not None and out.nbytes:
        _STREAM.gather(out, data, 0, _ONE_RUN, out.nbytes, False)
        return
    np.copyto(out, data)


def scatter_from(dst: Any, start: int, runs: Runs, src: Any) -> None:
    """Copy ``src`` (a contiguous buffer of exactly ``runs.nbytes``) into the runs of ``dst``
    (a writable buffer; the region begins ``start`` bytes in)."""
    data = np.frombuffer(src, np.uint8)
    if data.nbytes != runs.nbytes:
        raise ValueError(f"src is {data.nbytes} bytes; the runs are {runs.nbytes}")
    if _STREAM is not None:
        _STREAM.scatter(dst, start, runs.offsets, data, runs.run)
        return
    np.copyto(_strided(dst, start, runs, writable=True), data.reshape(runs.shape + (runs.run,)))
