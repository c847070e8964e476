"""Async restores (vLLM's ``load_async``) on one thread, each with a deadline.

A request whose load is async waits in WAITING_FOR_REMOTE_KVS until ``get_finished`` reports
it, so a stalled store would hold it there for as long as the stall, and every async load
queued behind it too. A load not done ``timeout_s`` after it was submitted is given up: it is
reported finished with every block failed (vLLM recomputes them), and the read still in the
store can no longer write into the request's blocks: the copy runs under its ``LayerRun``'s
guard, and ``cancel`` waits for a copy under way and stops any later one. Loads still queued
behind a given-up load that is stuck are given up with it, and while it is stuck new loads
fail at once instead of queueing.

Threads: ``submit``/``finished``/``close`` on vLLM's forward thread; ``load`` on the async
thread (it receives the load's ``LayerRun`` and must copy only inside ``run.guard()``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvtier.prefetch import LayerRun

from .protocol import LoadOutcome, LoadSpec

log = logging.getLogger(__name__)

Result = tuple[LoadOutcome, list[int]]  # the outcome and the blocks vLLM must recompute
Load = Callable[[LoadSpec, Any, LayerRun], Result]


@dataclass
class _Pending:
    spec: LoadSpec
    future: Future[Result]
    run: LayerRun
    deadline: float


def given_up(spec: LoadSpec) -> Result:
    return LoadOutcome.none_of(spec, "timeout"), list(spec.block_ids)


class AsyncLoads:
    def __init__(self, load: Load, timeout_s: float, thread_init: Callable[[], None] | None = None) -> None:
        self._load, self.timeout_s = load, timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-async-load", initializer=thread_init)
        self._pending: dict[str, _Pending] = {}
        self._failed_now: dict[str, Result] = {}
        self._stuck: Future[Result] | None = None  # a given-up load still in the store

    def submit(self, spec: LoadSpec, after: Any) -> None:
        """Start ``spec``'s restore (``after``: the copier's ordering token for it)."""
        if self.stalled:
            self._failed_now[spec.req_id] = given_up(spec)
            return
        self._stuck = None
        run = LayerRun(1)
        future = self._pool.submit(self._load, spec, after, run)
        self._pending[spec.req_id] = _Pending(spec, future, run, time.monotonic() + self.timeout_s)

    def all_done(self) -> bool:
        """No restore is running or queued (a given-up one may still be in the store)."""
        return all(p.future.done() for p in self._pending.values())

    @property
    def stalled(self) -> bool:
        """A given-up load is still in the store (new loads fail at once meanwhile)."""
        return self._stuck is not None and not self._stuck.done()

    def __len__(self) -> int:
        return len(self._pending) + len(self._failed_now)

    def finished(self) -> dict[str, Result]:
        """The loads that completed or were given up since the last call, by request id."""
        done, self._failed_now = self._failed_now, {}
        if not self._pending:
            return done
        now = time.monotonic()
        expired = [r for r, p in self._pending.items() if not p.future.done() and now >= p.deadline]
        for req_id in expired:
            self._give_up(req_id)
        for req_id in [r for r, p in self._pending.items() if p.future.done()]:
            done[req_id] = self._pending.pop(req_id).future.result()
        done.update(self._failed_now)
        self._failed_now = {}
        return done

    def _give_up(self, req_id: str) -> None:
        p = self._pending.get(req_id)
        if p is None:  # given up already, queued behind an earlier stuck load
            return
        p.run.cancel()  # returns once no copy of this load runs or will start
        if p.future.done():  # it completed meanwhile: its result stands
            return
        del self._pending[req_id]
        self._failed_now[req_id] = given_up(p.spec)
        log.warning("kvtier: async restore of %s not done %.2f s after it was queued "
                    "(async_load_timeout_s); giving it up, vLLM recomputes %d blocks",
                    req_id, self.timeout_s, len(p.spec.block_ids))
        if p.future.running():
            # One thread: every other unfinished load is queued behind this stuck read.
            self._stuck = p.future
            for other in [r for r, q in self._pending.items() if not q.future.done()]:
                queued = self._pending.pop(other)
                queued.future.cancel()
                queued.run.cancel()  # started meanwhile: it copies nothing
                self._failed_now[other] = given_up(queued.spec)

    def close(self) -> None:
        self._pool.shutdown(wait=not self.stalled, cancel_futures=self.stalled)
