"""Worker half: owns the store, answers lookups, restores and captures paged KV blocks.

Threads
    forward thread (vLLM's): start_load_kv, wait_for_layer_load, save_kv_layer, wait_for_save,
        get_finished, get_block_ids_with_load_errors, build_worker_meta.
    loader thread (``LayerPipeline``): sync restores, layer by layer, during the forward.
    async thread: restores of ``load_async`` requests while other requests run (asyncloads.py).
    prefetch pool: store loads started by lookups. saver thread: encode + store captured chunks.
    lookup server threads: ``LookupAnswerer.handle`` (lookups.py) for the scheduler.
Failure
    A load that falls short (miss, corrupt chunk, dead tier) restores the good leading blocks
    and reports the rest through ``get_block_ids_with_load_errors`` (vLLM recomputes them); saves
    of a request whose sync load failed in the same step are dropped (their KV was computed
    over bad blocks). Nothing raises into the engine from the store.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtier.cache import PrefixCache
from kvtier.chunk import HEADER_SIZE
from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.prefetch import Cancelled, LayerPipeline, LayerRun, LoadedRange, Prefetcher
from kvtier.store import TieredStore

from .asyncloads import AsyncLoads, given_up
from .blocks import PagedLayout, detect_layout, heads_dim, kv_views
from .capture import StepCapture
from .copier import Copier, RestoreItem
from .devcopier import make_copier
from .events import WorkerEvents
from .inflight import InflightChunks
from .ipc import LookupServer, socket_path
from .loadplan import CostModel
from .local_probe import held_locally, probes_every_tier
from .lookups import LookupAnswerer, signature_covers
from .namespace import EngineInfo, TenantCaches, engine_namespace, tenant_cache
from .partial import chunk_tokens_at
from .protocol import (
    KVTierMetadata,
    KVTierWorkerMeta,
    LoadOutcome,
    LoadSpec,
)
from .restorebufs import RestoreBuffers
from .saver import Saver
from .settings import VllmSettings
from .staging import StagingPool
from .stats import ConnectorMetrics, KVTierStats, StatsCollector
from .steps import SavedSteps
from .syncrestore import SyncRestore
from .threads import background_pinner, log_failure, on_spare_cpus, pin_existing

log = logging.getLogger(__name__)
_LAYER_NO = re.compile(r"layers\.(\d+)\.")


class WorkerSide:
    def __init__(self, cfg: KVTierConfig, settings: VllmSettings, info: EngineInfo) -> None:
        self.cfg, self.settings, self.info = cfg, settings, info
        self.chunk = cfg.chunk_tokens
        self.stats = StatsCollector(rank=info.rank)  # per-rank figures: see stats.py
        self.enabled = False
        # Per tenant salt, most recent last; bounded, since cache_salt may be per user or per
        # conversation (a PrefixCache is cheap to make again; it holds no chunk state).
        self._caches = TenantCaches()
        self._errors: set[int] = set()
        self._outcomes: dict[str, LoadOutcome] = {}
        self._steps = SavedSteps()  # what recent steps saved, for a failed step (steps.py)
        self._short_now: set[str] = set()  # this step's sync loads failed without a run
        self.events: WorkerEvents | None = None  # KV events (rank 0, when vLLM publishes them)
        self.inflight = InflightChunks()  # chunk keys being captured or written (capture.py)

    # --- setup ----------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=lambda n: (int(m.group(1)) if (m := _LAYER_NO.search(n)) else 1 << 30))
        first = kv_caches[names[0]]
        info = self.info
        shape = tuple(first.shape)
        heads, head_dim = heads_dim(shape, info.block_size, info.mla)
        self.layout: PagedLayout = detect_layout(first, backend=info.backend, block_size=info.block_size,
                                                 num_kv_heads=heads, head_dim=head_dim, isa=info.isa,
                                                 mla=info.mla)
        self.names = names
        self.index = {n: i for i, n in enumerate(names)}
        self.views = [kv_views(kv_caches[n], self.layout) for n in names]
        self.torch_dtype = first.dtype
        self.base_spec = engine_namespace(info, self.layout, first, len(names), heads, head_dim, self.chunk,
                                          self.cfg.hash)
        self.chunk_shape = self.base_spec.layout.chunk_shape(self.chunk)
        self.chunk_bytes = int(np.prod(self.chunk_shape)) * first.element_size()
        self.costs = CostModel(self.settings.reprobe_s, self.settings.prefill_prior_tokens_per_s,
                               self.settings.probe_share)
        self.metrics = Metrics(label_values=self.cfg.metrics_label_values)
        self.cmetrics = ConnectorMetrics(self.metrics)
        # vLLM's CPU worker binds its compute thread(s) to some cores; kvtier's threads would
        # inherit that mask and steal cycles from the forward pass. Run them on the others:
        # the store is built on those (its writer thread and a grpc tier's native threads
        # start there), and the Python threads started later are moved by ``pin``.
        pin = background_pinner()
        with on_spare_cpus(pin):
            self.store = TieredStore.from_config(self.cfg, self.metrics)
        self.cmetrics.declare_tiers(tuple(t.name for t in self.store.tiers))
        self.copier: Copier = make_copier(first.device, pin)
        pin_existing("kvtier", pin)  # and name the store's Python threads for top -H
        if info.kv_events and info.rank == 0:
            self.events = WorkerEvents(self.settings.events_queue_keys,
                                       on_drop=lambda n: self.stats.add(kv_events_dropped=n))
            self.store.listen(self.events)
        self.prefetcher = Prefetcher(self.settings.prefetch_workers, self.settings.prefetch_max_bytes,
                                     thread_init=pin, on_drop=lambda r: self.restore_bufs.release(r))
        self.pipeline = LayerPipeline(thread_init=pin)
        self.async_loads = AsyncLoads(self._async_load, self.settings.async_load_timeout_s, pin)
        self.saver = Saver(self.cache_for, self.chunk, self.settings.save_queue_depth, pin,
                           self.stats, self.cmetrics, probed=self._probes_all)
        self.use_copier(self.copier)
        path = socket_path(info.engine_id, info.dp_rank, info.rank, self.settings.socket_dir)
        self.answerer = LookupAnswerer(self.cache_for, self.chunk, info.block_size, self.prefetcher,
                                       lambda: self.restore_bufs, self.settings.partial_probes, self.stats,
                                       on_lookup=self.events.bind_request if self.events else None,
                                       on_partial=self.events.mute_partial if self.events else None,
                                       decide=self._decide)
        self.server = LookupServer(path, self.answerer.handle, thread_init=pin)
        if self.settings.metrics_port and info.rank == 0:
            from prometheus_client import start_http_server

            with on_spare_cpus(pin):  # its server thread
                start_http_server(self.settings.metrics_port, registry=self.metrics.registry)
        self.enabled = True
        log.info("kvtier: %d layers, layout %s, chunk %d tokens, tiers %s, lookups on %s",
                 len(names), self.layout.kind, self.chunk, [t.name for t in self.store.tiers], path)

    def use_copier(self, copier: Copier, staging_bytes: int | None = None,
                   restore_bytes: int | None = None) -> None:
        """Restore and capture through ``copier``, with fresh staging pools (tests put the
        worker on the simulated device this way; call before the first step)."""
        self.copier = copier
        nbytes = self.settings.save_staging_bytes if staging_bytes is None else staging_bytes
        # Room for the chunk header in front of each captured chunk: the saver frames it there
        # and stores the slot itself (no encode copy, no per-chunk allocation; saver.py).
        self.pool = StagingPool(nbytes, self.chunk_shape, self.torch_dtype, copier.host_buffer,
                                head=HEADER_SIZE)
        rbytes = self.settings.restore_staging_bytes if restore_bytes is None else restore_bytes
        self.restore_bufs = RestoreBuffers(rbytes, self.chunk_shape,
                                           self.torch_dtype, copier.host_buffer, self._count_pageable)
        self.sync = SyncRestore(self.pipeline, copier, self.restore_bufs, self.views, self._fetch,
                                self._plan, self.settings.sync_load_timeout_s)
        self.capture = StepCapture(copier, self.pool, self.saver, self.views, self.chunk,
                                   self.info.block_size, self.stats, self.cache_for, self.inflight,
                                   self._stored_locally)

    def _probes_all(self) -> bool:  # read per save: tests swap the store after ``register``
        return probes_every_tier(self.store)

    def _stored_locally(self, keys: Sequence[bytes]) -> int:
        # A chunk a failed step's purge is about to delete is not "stored": capture it again.
        return self._steps.first_purging(keys[:held_locally(self.store, keys)])

    def cache_for(self, salt: bytes) -> PrefixCache:
        return self._caches.get(salt, lambda: tenant_cache(self.store, self.cfg, self.base_spec, salt))

    # --- loads ------------------------------------------------------------------------------------------
    def _count_pageable(self, n: int) -> None:
        self.stats.add(load_pageable_chunks=n)
        self.cmetrics.load_pageable_chunks.inc(n)

    def _fetch(self, spec: LoadSpec) -> LoadedRange:
        """The verified chunks for ``spec``: from the prefetch if it covers them, else loaded now."""
        c0, c1 = spec.start // self.chunk, -(-spec.end // self.chunk)
        job = self.prefetcher.pop(spec.req_id)
        cache = self.cache_for(spec.salt)
        if job is not None and not signature_covers(job.signature, spec.salt, c0, c1 * self.chunk,
                                                    spec.partial_end):
            self.prefetcher.drop(job)
            job = None
        if job is not None:
            if not job.done():
                t0 = time.perf_counter()
                res = job.result()
                waited = time.perf_counter() - t0
                self.stats.add(prefetch_waits=1, prefetch_wait_seconds=waited)
                self.cmetrics.prefetch_wait_seconds.observe(waited)
            else:
                res = job.result()
            if res is not None:
                return res
        tokens = np.frombuffer(spec.tokens, dtype="<u4")
        if spec.partial_end:
            return self.restore_bufs.load(cache, tokens[:spec.partial_end], c0, 0, spec.partial_end)
        return self.restore_bufs.load(cache, tokens[:c1 * self.chunk], c0, c1)

    def _plan(self, spec: LoadSpec, res: LoadedRange) -> tuple[list[RestoreItem], LoadOutcome]:
        c, bs = self.chunk, self.info.block_size
        self.costs.observe_load(res.per_tier, res.nbytes, res.seconds, time.monotonic())
        ok_end = min(spec.end, (res.start_chunk + len(res.payloads)) * c)
        ok_end = max(spec.start, ok_end)
        items = []
        for j in range(len(res.payloads)):
            lo = (res.start_chunk + j) * c
            a, b = max(lo, spec.start), min(lo + c, ok_end)
            if a < b:
                shape = self.base_spec.layout.chunk_shape(chunk_tokens_at(res.start_chunk + j, c, spec.partial_end))
                p = self.restore_bufs.payload(res, j, shape, self.torch_dtype)
                ids = spec.block_ids[(a - spec.start) // bs:(b - spec.start) // bs]
                items.append(RestoreItem(p, a - lo, b - a, ids))
        outcome = LoadOutcome(spec.start, spec.end, ok_end, dict(res.per_tier),
                              res.reason if ok_end < spec.end else "", res.seconds, res.nbytes)
        return items, outcome

    def _decide(self, runs: Sequence[tuple[str, int]], start: int, full: int) -> tuple[int, int, dict[str, int], float]:
        return self.costs.answer(runs, start, full, self.chunk, self.chunk_bytes,  # loadplan.py
                                 cut=self.settings.load_decision == "auto")

    def start_load(self, meta: KVTierMetadata) -> None:
        if not self.enabled:
            return
        if self.events is not None and meta.saves:  # keys first: the saver's puts report them
            self.events.bind_saves(meta.saves, self.cache_for)
        if meta.skipped_tokens:
            self.cmetrics.load_skipped_tokens.inc(meta.skipped_tokens)
        if meta.dropped:
            self.prefetcher.discard(meta.dropped)
        for failed in meta.purge_steps:
            self._steps.purge(failed, self.saver, lambda: self.store, self.cache_for)
        self._steps.remember(meta.step, meta.saves)
        if not meta.loads:  # most steps: return before any per-load work
            return
        for spec in meta.loads:
            if spec.is_async:
                # Taken here, on the forward thread, whose current stream is the compute stream:
                # the load must follow the zeroing / preempted writes already enqueued on it.
                self.async_loads.submit(spec, self.copier.order_async())
        sync = [s for s in meta.loads if not s.is_async]
        if not sync:
            return
        if self.sync.running:  # never expected: wait_for_save ends every step
            self._finish_sync_run()
        if not self.sync.start(sync):
            # The layer thread is still inside a store read an earlier step gave up on: these
            # loads would queue behind it. Recompute them now instead of waiting again.
            for spec in sync:
                self._record(spec.req_id, LoadOutcome.none_of(spec, "timeout"), spec.block_ids)
                self._short_now.add(spec.req_id)

    def _async_load(self, spec: LoadSpec, after: Any, run: LayerRun) -> tuple[LoadOutcome, list[int]]:
        """On the async thread (asyncloads.py): copies only under ``run.guard()``."""
        if run.cancelled:  # given up while queued
            return given_up(spec)
        t0 = time.perf_counter()
        res: LoadedRange | None = None
        try:
            res = self._fetch(spec)
            items, outcome = self._plan(spec, res)
            with run.guard():
                self.copier.restore_blocking(self.views, items, after)
        except Cancelled:  # the read outlived async_load_timeout_s: the request recomputes
            outcome = LoadOutcome.none_of(spec, "timeout")
        except Exception as exc:  # never out of result() into vLLM's step: recompute instead
            log_failure(log, f"async restore of {spec.req_id}", exc)
            outcome = LoadOutcome.none_of(spec, "error")
        finally:
            if res is not None:
                self.restore_bufs.release(res)  # restore_blocking returned: copies ran (R4)
        outcome.seconds = time.perf_counter() - t0
        return outcome, self._failed_blocks(spec, outcome)

    def _failed_blocks(self, spec: LoadSpec, outcome: LoadOutcome) -> list[int]:
        return list(spec.block_ids[(outcome.ok_end - spec.start) // self.info.block_size:])

    def wait_layer(self, layer_name: str) -> None:
        layer = self.index.get(layer_name)
        if layer is not None:
            self.sync.wait(layer)

    def _finish_sync_run(self) -> set[str]:
        """Join this step's restore; returns the requests whose load fell short."""
        short: set[str] = set()
        for spec, outcome in self.sync.finish():
            self._record(spec.req_id, outcome, self._failed_blocks(spec, outcome))
            if outcome.ok_end < spec.end:
                short.add(spec.req_id)
        return short

    def _record(self, req_id: str, outcome: LoadOutcome, failed: Sequence[int]) -> None:
        self._errors.update(failed)
        self._outcomes[req_id] = outcome
        good = outcome.ok_end - outcome.start
        self.stats.add(load_requests=1, load_tokens=good, load_bytes=outcome.nbytes,
                       load_seconds=outcome.seconds)
        self.cmetrics.load_seconds.observe(outcome.seconds)
        for tier, n in outcome.per_tier.items():
            self.cmetrics.load_tokens.labels(tier).inc(n * self.chunk)
        if failed:
            reason = outcome.reason or "error"
            self.stats.add(load_failed_tokens=outcome.end - outcome.ok_end)
            self.stats.add_by("failures_by_reason", reason)
            self.cmetrics.load_failures.labels(reason).inc()
            log.warning("kvtier: %s restored %d of %d tokens (%s); vLLM recomputes %d blocks",
                        req_id, good, outcome.end - outcome.start, reason, len(failed))

    # --- saves (capture.py; nothing raises into the engine from a save) ------------------------------
    def capture_layer(self, meta: KVTierMetadata, layer_name: str) -> None:
        layer = self.index.get(layer_name) if self.enabled else None
        if layer is not None:
            self.capture.layer(meta.saves, layer)

    def end_step(self, meta: KVTierMetadata | None) -> None:
        """wait_for_save: finish this step's restore, then hand the captured chunks over."""
        if not self.enabled:
            return
        self.costs.step_end(time.perf_counter(), measured=not self.sync.running)  # a restore wait is no prefill
        short = self._finish_sync_run() | self._short_now
        self._short_now = set()
        saves = meta.saves if meta is not None else []
        self.capture.end(saves, short)
        if short and saves and meta is not None:  # dropped: the scheduler plans them again
            self._steps.failed(meta.step)
            log.warning("kvtier: a load of step %d fell short; its %d save(s) are dropped",
                        meta.step, len(saves))

    # --- step results -------------------------------------------------------------------------------------
    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Async loads that completed (vLLM's ``finished_recving``); their failed blocks are
        queued for ``take_errors`` in the same step, as vLLM requires."""
        if not self.enabled:
            return set()
        if finished_req_ids:
            self.prefetcher.discard(list(finished_req_ids))
        if not len(self.async_loads):
            return set()
        done = self.async_loads.finished()
        for req_id, (outcome, failed) in done.items():
            self._record(req_id, outcome, failed)
        return set(done)

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def worker_meta(self) -> KVTierWorkerMeta | None:
        events = self.events.drain() if self.events is not None else None
        loads, self._outcomes = self._outcomes, {}
        failed = self._steps.take_failed()
        if not loads and events is None and not failed:
            return None
        return KVTierWorkerMeta(loads, events, failed)

    def take_stats(self) -> KVTierStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        if not self.enabled:
            return
        self.enabled = False
        self.server.close()
        self.saver.close(timeout_s=30)
        self.pipeline.close()
        self.async_loads.close()
        self.prefetcher.close()
        self.store.flush(timeout_s=30)
        self.store.close()

