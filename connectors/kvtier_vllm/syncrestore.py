"""One step's synchronous restore: fetched and copied layer by layer on the layer thread while
vLLM's forward pass waits for each layer (``wait_for_layer_load``), with a deadline.

``start`` queues the run (fetch every sync load of the step from its prefetch or the store, then
restore layer 0..L-1 into vLLM's blocks); ``wait(layer)`` blocks the forward thread until that
layer is in place; ``finish`` (``wait_for_save``) joins the run and returns each load's outcome.

Deadline: the forward pass waits at most ``timeout_s`` from the step's start. Past it the run is
cancelled (kvtier.prefetch.LayerRun.cancel: no layer copy starts after that, and the read still
stuck in the store must pass ``LayerRun.guard`` to touch anything, so it can never write into
blocks vLLM has since reused) and every load of the run is a failure (``timeout``; vLLM
recomputes). While such a read is still stuck, ``start`` refuses new runs (they would queue
behind it): their loads fail at once.

Threads: every method on vLLM's forward thread; ``before``/``step`` on the layer thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvtier.prefetch import Cancelled, LayerPipeline, LayerRun, LoadedRange

from .copier import Copier, RestoreItem, RestorePlan, Views
from .protocol import LoadOutcome, LoadSpec
from .restorebufs import RestoreBuffers

log = logging.getLogger(__name__)

Fetch = Callable[[LoadSpec], LoadedRange]
Plan = Callable[[LoadSpec, LoadedRange], tuple[list[RestoreItem], LoadOutcome]]


class SyncRestore:
    def __init__(self, pipeline: LayerPipeline, copier: Copier, bufs: RestoreBuffers,
                 views: Sequence[Views], fetch: Fetch, plan: Plan, timeout_s: float) -> None:
        self._pipeline, self._copier, self._bufs = pipeline, copier, bufs
        self._views, self._fetch, self._plan = views, fetch, plan
        self.timeout_s = timeout_s
        self._run: LayerRun | None = None
        self._stalled: LayerRun | None = None  # a run given up on while still in the store
        self._specs: list[LoadSpec] = []
        self._done: list[tuple[LoadSpec, LoadOutcome]] = []
        self._slots: list[int] = []
        self._deadline = self._t_load = self._t_fetched = self._t_restored = self._waited = 0.0

    @property
    def running(self) -> bool:
        return self._run is not None

    def start(self, sync: list[LoadSpec]) -> bool:
        """Queue the run of ``sync``; False (nothing queued) while a given-up read is stuck."""
        if self._stalled is not None and not self._stalled.finished:
            return False
        self._stalled = None
        plan: list[RestorePlan] = []
        done: list[tuple[LoadSpec, LoadOutcome]] = []
        slots: list[int] = []  # back to the pool once finish_restore's fence completed
        box: list[LayerRun] = []

        def before() -> None:  # on the layer thread; after a cancel, touches nothing shared
            items: list[RestoreItem] = []
            for spec in sync:
                res = self._fetch(spec)
                # Planned (which times the read for the cost model) even when given up: a read
                # that outlived the deadline is how the model learns that the tier is slow.
                spec_items, outcome = self._plan(spec, res)
                try:
                    with box[0].guard():
                        slots.extend(self._bufs.slots(res))
                except Cancelled:
                    self._bufs.release(res)
                    raise
                items.extend(spec_items)
                done.append((spec, outcome))
            with box[0].guard():
                plan.append(self._copier.prepare_restore(items))  # one block index for the step
                self._t_fetched = time.perf_counter()

        def step(layer: int) -> None:
            self._copier.restore_layer(self._views[layer], layer, plan[0])
            self._t_restored = time.perf_counter()

        self._specs, self._done, self._slots = sync, done, slots
        self._t_load = self._t_fetched = self._t_restored = time.perf_counter()
        self._waited = 0.0
        self._deadline = self._t_load + self.timeout_s
        self._copier.begin_restore(len(self._views))
        self._run = self._pipeline.start(len(self._views), step, before)
        box.append(self._run)
        return True

    def wait(self, layer: int) -> None:
        run = self._run
        if run is None:
            return
        t0 = time.perf_counter()
        if not run.wait(layer, max(0.0, self._deadline - t0)) and not run.reached(layer):
            # The store is stalled: give up (vLLM recomputes) rather than hold the forward pass.
            run.cancel()
            log.warning("kvtier: sync restore not done %.2f s after it started (sync_load_timeout_s);"
                        " giving it up, vLLM recomputes", self.timeout_s)
        self._waited += time.perf_counter() - t0
        self._copier.layer_ready(layer)

    def finish(self) -> list[tuple[LoadSpec, LoadOutcome]]:
        """Join the run (within the deadline); each load's outcome (empty: no run)."""
        run, self._run = self._run, None
        if run is None:
            return []
        if not run.join(max(0.0, self._deadline - time.perf_counter())):
            run.cancel()  # no step runs from here on; a read still in the store finishes alone
            self._stalled = run
        fence = self._copier.finish_restore()
        self._bufs.release_after(self._slots, fence)
        self._slots = []
        log.debug("kvtier: sync restore of %d request(s): fetched at %.1f ms, restored at %.1f ms, "
                  "forward waited %.1f ms", len(self._specs), 1e3 * (self._t_fetched - self._t_load),
                  1e3 * (self._t_restored - self._t_load), 1e3 * self._waited)
        seconds = self._t_restored - self._t_load
        done = {spec.req_id: outcome for spec, outcome in self._done}
        out = []
        for spec in self._specs:
            outcome = done.get(spec.req_id) or LoadOutcome.none_of(spec, "error")
            if not run.ok:
                outcome = LoadOutcome.none_of(spec, "timeout" if run.cancelled else "error")
            outcome.seconds = seconds
            out.append((spec, outcome))
        return out
