"""Page control of a lazily backed arena (a private anonymous mapping, or a memfd's shared one,
``CpuTier(lazy=True)``):
give a range's pages back to the OS, or fault them in before a write needs them. One
``madvise`` call each; ranges are page-aligned.

Why populate: a put into never-touched memory takes a page fault per 4 KiB (about 0.5-0.9 ms
per MiB on the VMs measured, more than the copy itself). ``MADV_POPULATE_WRITE`` (Linux 5.14)
faults a whole range in with one call, at 1.6-2x the rate of faulting it page by page, and it
can run on another thread before the put comes (kvtier-server's warm-ahead). It never changes
a byte that is already there: present pages are left alone, absent ones arrive zero-filled, so
it is safe while another thread writes the same range.
"""

from __future__ import annotations

import ctypes
import errno
import mmap

# <linux/mman.h>; Python's mmap module names it only from 3.13 on.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class PopulateUnsupported(OSError):
    """``EINVAL`` from ``MADV_POPULATE_WRITE``: the kernel has no such advice (before Linux
    5.14), or the range is not page-aligned (never, from the callers here)."""


def remove_pages(addr: int, nbytes: int, shared: bool = False) -> None:
    """Free the pages of ``[addr, addr + nbytes)``: ``MADV_DONTNEED`` on a private anonymous
    mapping frees them (the next write faults in a zeroed page); on a memfd's ``shared``
    mapping it would only unmap them, so ``MADV_REMOVE`` punches them out of the file (gone
    from every process's mapping; a read there then sees zeros). Raises OSError when the
    kernel refuses."""
    advice, name = (mmap.MADV_REMOVE, "MADV_REMOVE") if shared else (mmap.MADV_DONTNEED, "MADV_DONTNEED")
    if _libc.madvise(addr, nbytes, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({name}) of {nbytes} bytes refused (errno {err})")


def populate_pages(addr: int, nbytes: int) -> None:
    """Fault in the pages of ``[addr, addr + nbytes)`` as a write would, leaving every byte
    already there as it is. Raises :class:`PopulateUnsupported` on a kernel without
    ``MADV_POPULATE_WRITE``, OSError otherwise (``ENOMEM``: no memory for the pages;
    ``EFAULT``/``EHWPOISON``: a page could not be faulted in)."""
    if _libc.madvise(addr, nbytes, MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        kind = PopulateUnsupported if err == errno.EINVAL else OSError
        raise kind(err, f"madvise(MADV_POPULATE_WRITE) of {nbytes} bytes refused (errno {err}: "
                        f"{errno.errorcode.get(err, '?')})")
