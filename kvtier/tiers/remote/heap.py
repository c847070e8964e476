"""Keep freed large blocks in the process heap, so that fresh chunk ``bytes`` do not fault.

Why: the socket data path's ``get`` returns each chunk as a fresh ``bytes`` (the kernel copies
the body straight into it). glibc serves a block of a few MiB from the heap once an earlier one
was freed (its dynamic mmap threshold), but it also hands the top of the heap back to the OS
as soon as more than twice that threshold is free there (its dynamic trim threshold). A
``get`` of 8 MiB that the caller drops before the next one thus gives its pages back, and the
next ``get`` takes a page fault and a zeroed page for every 4 KiB it receives: measured on a
2-core VM, 147,000 faults in 3 s of 1 MiB GETs, half the throughput of the same GETs with the
pages kept.

:func:`retain_freed_blocks` sets, once per process, glibc's mmap threshold to its largest value
(32 MiB: blocks up to a kvtier chunk's default maximum come from the heap, as the dynamic
threshold would choose after the first such block) and its trim threshold to
``TRIM_THRESHOLD`` (the heap keeps up to that much free memory at its top for the next
allocation rather than returning it at once). Cost: a process that frees a large batch keeps
up to ``TRIM_THRESHOLD`` per malloc arena resident until it allocates again.

It does nothing when the process is not on glibc, or when the user chose malloc settings
already (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or a
``glibc.malloc`` tunable in ``GLIBC_TUNABLES``; setting one of them, even to glibc's default, is
how to keep glibc's own behaviour). Thread-safe and idempotent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the largest it accepts
TRIM_THRESHOLD = 64 << 20
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_lock = threading.Lock()
_done: bool | None = None  # None: not tried yet; else whether the thresholds were set


def retain_freed_blocks() -> bool:
    """Raise glibc's mmap and trim thresholds (see the module docstring); True when they are
    set (now or by an earlier call), False when this process's malloc is left as it is."""
    global _done
    with _lock:
        if _done is None:
            _done = _apply()
        return _done


def _apply() -> bool:
    if any(name in os.environ for name in _USER_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        log.debug("heap: malloc settings come from the environment; left as they are")
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (musl also has mallopt)
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        log.info("heap: glibc refused the mmap/trim thresholds; fresh chunk buffers may page-fault")
        return False
    return True
