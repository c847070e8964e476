"""Keep kvtier's worker threads off the cores the engine computes on, and name them.

vLLM's CPU worker binds one OpenMP thread per core it computes on; a thread the connector starts
inherits its creator's mask and would steal cycles from the forward pass. ``background_pinner``
returns a thread initializer that moves the calling thread to the other cores (no-op where the
engine is not pinned, e.g. GPU hosts, or where there is no affinity API) and gives it an OS
name (``top -H`` shows ``kvtier-saver``, ``kvtier-layers``, ...). No ``torch.set_num_threads``
here: in torch 2.13 it is process-wide and would shrink the engine's own OpenMP team.
``log_failure`` is how those threads report a job that failed: they live on either way.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)
# What a background job expects to fail with (store, I/O and shape trouble): one line each.
EXPECTED_FAILURES = (RuntimeError, ValueError, OSError)


def log_failure(logger: logging.Logger, what: str, exc: BaseException) -> None:
    """``what`` failed with ``exc``: one error line, with the traceback when ``exc`` is not an
    expected failure (a bug). The caller's thread goes on with its next job."""
    logger.error("kvtier: %s failed: %s", what, exc, exc_info=not isinstance(exc, EXPECTED_FAILURES))


def _compute_cpus() -> set[int]:
    """CPUs the engine computes on: vLLM's CPU worker binds one OpenMP thread per core, so
    the union of this process's single-CPU thread masks; else the calling thread's mask."""
    cpus: set[int] = set()
    try:
        for task in os.listdir("/proc/self/task"):
            mask = os.sched_getaffinity(int(task))
            if len(mask) == 1:
                cpus |= mask
    except (OSError, ValueError):
        cpus = set()
    return cpus or set(os.sched_getaffinity(0))


def background_pinner() -> Callable[[], None]:
    """A thread initializer moving the calling thread to the CPUs the engine does not compute
    on (no-op where the engine is not pinned, or the platform has no affinity API)."""
    spare: set[int] = set()
    if hasattr(os, "sched_getaffinity"):
        spare = set(range(os.cpu_count() or 1)) - _compute_cpus()
        log.info("kvtier: background threads on CPUs %s", sorted(spare) or "any")

    def pin() -> None:
        _name_os_thread(threading.current_thread().name)
        # No torch.set_num_threads here: in torch 2.13 it is process-wide and would shrink the
        # engine's own OpenMP team. kvtier's CPU copies are single-threaded numpy instead.
        if spare:
            try:
                os.sched_setaffinity(0, spare)
            except OSError as exc:  # e.g. a cpuset that excludes those CPUs
                log.debug("kvtier: cannot move thread to CPUs %s: %s", sorted(spare), exc)

    pin.spare = spare  # type: ignore[attr-defined]
    return pin


@contextmanager
def on_spare_cpus(pin: Callable[[], None]) -> Iterator[None]:
    """Run the body with the calling thread on ``pin``'s CPUs, then give it its own mask back.

    Why: threads inherit their creator's mask, and some are not Python threads ``pin`` could
    move later: gRPC's event-engine, timer and lifeguard threads start when a grpc tier's
    channel does (on vLLM's forward thread, bound to a compute core) and would then do every
    remote save's network work on the core the forward pass computes on. Build the store in
    here and every thread it starts, native or not, starts on the spare CPUs.
    No-op where ``pin`` has no CPU set (the engine is not pinned) or the platform has no
    affinity API; a failure to move the thread is logged and the body still runs."""
    spare = getattr(pin, "spare", None)
    if not spare or not hasattr(os, "sched_setaffinity"):
        yield
        return
    own = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, spare)
    except OSError as exc:
        log.debug("kvtier: cannot move the calling thread to CPUs %s: %s", sorted(spare), exc)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def _name_os_thread(name: str) -> None:
    """Show kvtier's threads by name in top -H / ps -L (Linux; best effort)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name[:15].encode(), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def pin_existing(prefix: str, pin: Callable[[], None]) -> None:
    """Apply ``pin``'s CPU set to already running threads named ``prefix*``."""
    spare = getattr(pin, "spare", None)
    if not spare or not hasattr(os, "sched_setaffinity"):
        return
    for t in threading.enumerate():
        if t.name.startswith(prefix) and t.native_id is not None and t is not threading.current_thread():
            try:
                os.sched_setaffinity(t.native_id, spare)
            except OSError as exc:
                log.debug("kvtier: cannot move thread %s: %s", t.name, exc)
            try:
                import ctypes

                ctypes.CDLL(None).pthread_setname_np(ctypes.c_ulong(t.ident or 0), t.name[:15].encode())
            except (OSError, AttributeError):
                pass
