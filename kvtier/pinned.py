"""Page-locked host memory without torch's pinned caching allocator.

torch's ``pin_memory=True`` goes through a power-of-two caching allocator: a 48 GiB arena locks
64 GiB. ``HostRegion`` maps exactly the bytes asked for (anonymous, page-aligned) and registers
them with ``cudaHostRegister`` in pieces (as vLLM's offloading region does), so the GPU copies
to and from them asynchronously at full link speed. Pieces are a multiple of ``align`` bytes
(the caller's slot size) and of the page size, so no slot straddles two registrations (a copy
over two registrations is not a pinned copy) and no page is registered twice.

A failed ``cudaHostRegister``/``cudaHostUnregister`` also leaves its error pending in the
calling thread's CUDA runtime state, where the next kernel launch check of that thread (the
engine's forward, when the connector registers on its thread) would report it as its own
failure; it is cleared here (``cudaGetLastError`` of the runtime torch loaded), as vLLM does.

torch stays optional: registration is attempted only when torch is importable and a CUDA
device is present; otherwise (or when registration fails, e.g. locked-memory limits) the region
stays pageable and ``pinned`` is False. Threads: build and ``close`` on one thread; the bytes
themselves are the caller's to share.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import math
import mmap
import os
import sys
from typing import Any

log = logging.getLogger(__name__)

PIECE_BYTES = 1 << 30
HUGE_PAGE = 2 << 20


def _address(buf: mmap.mmap | memoryview) -> int:
    """Where a writable buffer's first byte lies in memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def registration_pieces(nbytes: int, align: int = 1) -> list[tuple[int, int]]:
    """(offset, size) of the ``cudaHostRegister`` calls covering ``nbytes``: about
    ``PIECE_BYTES`` each, every boundary a multiple of ``align`` and of the page size (so a
    slot of ``align`` bytes never spans two pieces and no page is registered twice)."""
    unit = math.lcm(max(align, 1), mmap.PAGESIZE)
    piece = max(1, PIECE_BYTES // unit) * unit
    return [(off, min(piece, nbytes - off)) for off in range(0, nbytes, piece)]


def _clear_cuda_error() -> None:
    """Reset the calling thread's pending CUDA runtime error (see the module docstring).
    torch's ``cudart()`` bindings have no ``cudaGetLastError``: call it in the libcudart the
    process already loaded (the same runtime instance torch uses; another copy of the library
    would hold another error state)."""
    path = None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                name = line[line.find("/"):].strip() if "/" in line else ""
                if name.rsplit("/", 1)[-1].startswith(("libcudart.", "libcudart-")):
                    path = name
                    break
        if path is not None:
            ctypes.CDLL(path).cudaGetLastError()
            return
    except (OSError, AttributeError) as exc:
        log.warning("host region: cannot clear the CUDA error of a failed registration: %s", exc)
        return
    log.warning("host region: no libcudart loaded; the CUDA error of a failed registration "
                "stays pending")


def _advise_huge(region: mmap.mmap) -> bool:
    """Ask for transparent huge pages on ``region``; False where the kernel refuses the advice
    (THP not built in, or no MADV_HUGEPAGE off Linux): it then stays on small pages."""
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError) as exc:
        log.debug("host region: no transparent huge pages (%s)", exc)
        return False
    return True


def _cudart(import_torch: bool) -> Any:
    torch = sys.modules.get("torch")
    if torch is None and import_torch:
        try:
            import torch
        except ImportError:
            return None
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.cudart()


def _sealed_memfd(nbytes: int) -> int:
    """A memfd of ``nbytes`` (its pages allocated only when written) whose size no one can
    change again: a process mapping it can never lose pages under its mapping. Its mode is
    0400: a memfd is created 0777, and whoever holds a read-only descriptor of it could
    otherwise reopen ``/proc/self/fd/N`` for writing and rewrite stored chunks after they were
    verified (root still can: the host is trusted). This descriptor, opened read-write at
    creation, keeps mapping it writable. (``F_SEAL_FUTURE_WRITE`` would also forbid the
    ``MADV_REMOVE`` that frees a slot's pages.)"""
    fd = os.memfd_create("kvtier-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o400)
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except OSError:
        os.close(fd)
        raise
    return fd


class HostRegion:
    """``nbytes`` of anonymous memory, registered with CUDA when ``pin`` asks and CUDA is there.

    ``pin``: "never", "auto" (only when the process already imported torch, so a daemon never
    pays for its import), "always" (import torch; warn when pinning is impossible).
    """

    def __init__(self, nbytes: int, pin: str = "auto", align: int = 1, private: bool = False,
                 huge_pages: bool = False, memfd: bool = False) -> None:
        """``private``: a private anonymous mapping (its pages are freed by MADV_DONTNEED and
        fault in at about two thirds of the cost of the default shared one's, measured here);
        the default is a shared anonymous (shmem) mapping. ``huge_pages`` (private only):
        transparent huge pages where the kernel offers them (``huge``: advised). ``memfd``
        (not with ``private``): the shared mapping of a memfd whose size is sealed, so that
        :meth:`reader_fd` can hand other processes a read-only view that can never SIGBUS
        (kvtier-server's arena reads). Raises OSError where no memfd can be made."""
        if pin not in ("never", "auto", "always"):
            raise ValueError(f"pin must be never, auto or always, got {pin!r}")
        if memfd and private:
            raise ValueError("host region: a memfd region is shared, not private")
        self.nbytes = nbytes
        self.private = private
        # Set before anything can raise: __del__ (close) runs on a half-built region too.
        self._registered: list[int] = []
        self._cudart: Any = None
        self.pinned = False
        self.fd = -1
        self.fd = _sealed_memfd(max(nbytes, 1)) if memfd else -1
        # A private region on huge pages starts on a huge-page boundary (mapped HUGE_PAGE bytes
        # longer), so slots of 2 MiB multiples are whole huge pages (freed whole by MADV_DONTNEED).
        self.huge = private and huge_pages
        if memfd:
            self.map = mmap.mmap(self.fd, max(nbytes, 1))
        else:
            flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
            self.map = mmap.mmap(-1, nbytes + HUGE_PAGE if self.huge else max(nbytes, 1), flags=flags)
        offset = -_address(self.map) % HUGE_PAGE if self.huge else 0
        self.huge = self.huge and _advise_huge(self.map)
        self.view = memoryview(self.map)[offset : offset + nbytes]
        self.pieces = registration_pieces(nbytes, align)  # what registration covers, piece by piece
        if pin != "never" and nbytes > 0:
            self._register(pin)

    def _register(self, pin: str) -> None:
        level = logging.WARNING if pin == "always" else logging.DEBUG
        cudart = _cudart(import_torch=pin == "always")
        if cudart is None:
            log.log(level, "host region: no torch with CUDA; %d bytes stay pageable", self.nbytes)
            return
        base = _address(self.view)
        self._cudart = cudart
        for off, size in self.pieces:
            rc = int(cudart.cudaHostRegister(base + off, size, 0))
            if rc != 0:
                _clear_cuda_error()
                log.warning("host region: cudaHostRegister of %d bytes failed (error %d); the "
                            "region stays pageable", size, rc)
                self._unregister()
                return
            self._registered.append(base + off)
        self.pinned = True

    def _unregister(self) -> None:
        for ptr in self._registered:
            if int(self._cudart.cudaHostUnregister(ptr)) != 0:
                _clear_cuda_error()
        self._registered = []
        self.pinned = False

    def reader_fd(self) -> int:
        """A new read-only descriptor of a ``memfd`` region (the caller closes it): whoever
        holds it can map the region's bytes for reading, but neither write them nor change
        their size. Raises ValueError for a region that is not a memfd, OSError where the
        descriptor cannot be reopened (no /proc)."""
        if self.fd < 0:
            raise ValueError("host region: only a memfd region has reader descriptors")
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        """Unregister, and close a memfd region's descriptor (the mapping itself goes when the
        last view of it is dropped)."""
        if self._registered:
            self._unregister()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        # Nothing can be copying from a region nobody references: give the pages back to the
        # driver before the mapping goes, so a later mapping at this address can register.
        self.close()
