"""KVTierStorage: kvtier as SGLang's HiCache L3 storage backend, loaded by configuration.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name":"kvtier","module_path":"kvtier_sglang",
        "class_name":"KVTierStorage","interface_v1":1, ...kvtier config...}'

SGLang's ``StorageBackendFactory`` builds it as ``KVTierStorage(storage_config, kwargs)``; the
``HiCacheController`` then calls ``register_mem_pool_host`` (which opens the store: the page
geometry fixes the namespace) and, from its prefetch and backup threads, ``batch_exists`` /
``batch_get_v1`` / ``batch_set_v1`` with SGLang's hex page-hash chain as keys.

Contract (what SGLang relies on):
- ``batch_exists`` returns the number of *leading* pages present; SGLang MIN-reduces it over the
  TP ranks, and an MLA latent lives in one rank-independent namespace, so ranks agree (with
  tp_size > 1 only on a tier the ranks share: namespace.check_rank_sharing refuses the rest).
- Attach fails (ConfigError) where pages could not be served: see namespace.check_supported,
  check_rank_sharing, and ``on_host_pools_registered`` (hybrid models' sidecar pools).
- With SGLang's prefix keys (prefix.py), every store verb gets the call's whole prefix, so a
  kvtier-server cluster places pages where the other engines' connectors look for them.
- v1 methods return one bool per key, never ``None`` and never raise: a failure is per-page
  ``False``, a warning log line and a counter (``kvtier_stats()``), so SGLang's threads live on.
  A page that fails verification (checksum, namespace, key, shape) is refused, deleted and
  reported ``False``; it is never copied into the host pool.
- Pages are copied between the host pool's buffer and the store in kvtier's canonical chunk
  order (pages.py). With an in-process cpu tier, pages move straight between the pool and its
  arena (arena.py: a read verified in the arena, a single-tier write framed in its slot, one
  copy each). Other reads and writes go through a ring of reusable page-aligned chunk buffer
  sets of the calling thread (buffers.py): a read lands in them (``load_verified_into``:
  O_DIRECT in place on disk), is verified there and copied into the pool once, the next
  batches read meanwhile (readahead.py); a raw-codec write copies the page into one and
  frames the chunk around it, the earlier batches stored meanwhile (writebehind.py). No
  allocation per page on either path.

Threads: SGLang calls from its prefetch, backup and scheduler threads concurrently; the store
and PrefixCache are thread-safe, the host buffer regions of concurrent calls are disjoint
(SGLang owns that), and the counters take a lock. ``close`` closes the store it opened.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvtier.cache import PrefixCache, VerifiedRun
from kvtier.chunk import HEADER_SIZE, encode_chunk, page_aligned_buffer
from kvtier.codec import Buf, Codec
from kvtier.errors import ConfigError, KVTierError
from kvtier.store import TieredStore
from kvtier.tiers.base import Entry

from .arena import leasing_tier, page_framer, read_leased, writable_tier, write_in_place
from .buffers import ThreadBuffers
from .iothreads import IOThreads
from .legacy import LegacyTensorAPI
from .namespace import check_rank_sharing, check_supported, fit_slots, namespace_spec, store_keys
from .pages import PageGeometry, geometry_of, load_page, page_slots, page_view, save_page
from .prefix import PrefixKeys
from .readahead import read_ahead
from .remote import filling_tier, places_alike, read_visited, remote_tier, write_filled
from .settings import load_settings, slot_bytes_named
from .stats import BackendStats
from .usage import BackendUsage
from .writebehind import write_behind
from .written import WrittenKeys

log = logging.getLogger(__name__)

# Failures a storage call expects (one log line each). Nothing reaches SGLang's threads (an
# exception ends its prefetch or backup thread, L3 off for good): a bug fails the pages too.
_EXPECTED = (KVTierError, OSError, RuntimeError, ValueError, IndexError)


class KVTierStorage(LegacyTensorAPI, HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None,
                 *, store: TieredStore | None = None) -> None:
        """``store``: an already open store to use instead of building one from the config
        (tests, and processes that share one store between backends); not closed by us."""
        check_supported(storage_config)
        self.storage_config = storage_config
        self.cfg, self.settings = load_settings(storage_config.extra_config)
        if store is None:  # a store handed in is shared by whoever handed it to several backends
            check_rank_sharing(storage_config, self.cfg)
        self.kwargs = dict(kwargs or {})
        self.stats = BackendStats()
        self.mem_pool_host: Any = None
        self.namespace = b""
        self._store = store
        self._owns_store = store is None
        self._cache: PrefixCache | None = None
        self._geo: PageGeometry | None = None
        self._buffer: torch.Tensor | None = None
        self._bufs: ThreadBuffers | None = None
        self._io = IOThreads()  # batches read ahead and written behind
        self._written = WrittenKeys()
        self._local = threading.local()  # per-thread scratch page (backup vs scheduler thread)
        self.usage: BackendUsage | None = None  # engine usage reports (usage.py), once registered
        # An MLA latent is written once, by SGLang's storage-writer rank, into a tier the other
        # ranks read (check_rank_sharing); SGLang calls the others' batch_set_v1 not at all.
        self._writer = bool(storage_config.is_storage_writer)
        self._prefix = PrefixKeys(storage_config, self.cfg)
        self._pools_final = False  # on_host_pools_registered has run
        if not (storage_config.extra_config or {}).get("interface_v1"):
            log.warning("kvtier_sglang: interface_v1 is not set; SGLang will use the legacy "
                        "per-page tensor path (set \"interface_v1\": 1 for zero-copy)")

    # --- attach ----------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        geo = geometry_of(mem_pool_host, bool(self.storage_config.is_mla_model))
        cfg = fit_slots(self.cfg, geo, slot_named=slot_bytes_named(self.storage_config.extra_config))
        if self._store is None:
            self._store = TieredStore.from_config(cfg)
        spec = namespace_spec(self.storage_config, geo, cfg, self.settings)
        self._cache = PrefixCache(self._store, spec, codec=cfg.codec, shuffle=cfg.shuffle,
                                  tenant=cfg.tenant)
        self.namespace = spec.namespace_id()
        self._geo, self._buffer = geo, mem_pool_host.kv_buffer
        self._bufs = ThreadBuffers(geo.page_bytes)
        if self.usage is None:
            self.usage = BackendUsage(cfg, spec.model_id, geo.page_tokens)
        log.info("kvtier_sglang: %s %s pages of %d tokens, namespace %s (%s rank %d/%d), tiers %s",
                 "MLA" if geo.is_mla else "MHA", geo.layout, geo.page_tokens,
                 self.namespace.hex()[:16], spec.model_id, spec.rank, spec.world_size,
                 [t.name for t in self._store.tiers])

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Recorded as SGLang's base does; a sidecar registered after the attach (SGLang adds
        dynamic ones, e.g. a draft model's, through this call alone) is refused at once."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if self._pools_final:
            self._refuse_sidecars()

    def on_host_pools_registered(self) -> None:
        """SGLang's hook after the pool registrations of an attach; raising fails the attach.
        Refuses (ConfigError) a hybrid model's sidecar pools (Mamba state, SWA, DSA indexer,
        draft KV): SGLang moves them with ``batch_*_v2``, which this backend does not implement,
        so accepting them left every v2 call raising NotImplementedError behind a successful
        attach. The KV pool itself (registered here too, as ``kv``) is what the backend serves."""
        self._pools_final = True
        self._refuse_sidecars()

    def _refuse_sidecars(self) -> None:
        """ConfigError naming every registered pool other than the KV pool this backend serves
        (the anchor given to ``register_mem_pool_host``, which SGLang registers as ``kv``)."""
        pools = getattr(self, "registered_pools", {})  # the base class's record of v2 pools
        names = {str(getattr(name, "value", name)): pool for name, pool in pools.items()}
        sidecars = sorted(n for n, pool in names.items() if n != "kv" and pool is not self.mem_pool_host)
        if not sidecars:
            return
        # SGLang's hybrid controller does not roll its attach back when this raises (its
        # threads keep running at a runtime attach): close the store, so no call half-works.
        self.close()
        self._cache = None
        raise ConfigError(
            f"--hicache-storage-backend dynamic (kvtier_sglang): this model's host pools include "
            f"sidecar pools {sidecars} (a hybrid model: Mamba, SWA, DSA indexer or draft KV), "
            f"which SGLang stores through batch_*_v2, not implemented by kvtier_sglang; run it "
            f"without --hicache-storage-backend, or with a backend that implements v2")

    def _ready(self) -> tuple[PrefixCache, PageGeometry, torch.Tensor]:
        if self._cache is None or self._geo is None or self._buffer is None:
            raise RuntimeError("kvtier_sglang: not attached (no host pool registered, or the "
                               "attach was refused)")
        return self._cache, self._geo, self._buffer

    def _thread_buffers(self) -> ThreadBuffers:
        if self._bufs is None:
            raise RuntimeError("kvtier_sglang: no host pool registered (register_mem_pool_host)")
        return self._bufs

    def _fail(self, verb: str, n: int, exc: BaseException) -> None:
        self.stats.add(f"{verb}_errors")
        if isinstance(exc, _EXPECTED):
            log.warning("kvtier_sglang: %s of %d pages failed: %s: %s", verb, n, type(exc).__name__, exc)
        else:
            log.error("kvtier_sglang: %s of %d pages failed on an unexpected %s (a bug; the pages "
                      "count as failed)", verb, n, type(exc).__name__, exc_info=exc)

    # --- v1: what the controller calls ---------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Number of leading ``keys`` present in some tier (0 on failure, with a log line)."""
        if not keys or not self.settings.load:
            return 0
        try:
            cache, _, _ = self._ready()
            xkeys = store_keys(self.namespace, keys)
            hit = cache.store.lookup(xkeys, prefix=self._prefix.of(self.namespace, extra_info, xkeys))
            hits = hit.hits
        except Exception as exc:  # never into SGLang's threads: see _EXPECTED
            self._fail("exists", len(keys), exc)
            return 0
        if self.usage is not None:
            self.usage.on_exists(len(keys), hit, xkeys[0])
        self.stats.add("exists_pages_hit", hits)
        self.stats.add("exists_pages_missed", len(keys) - hits)
        return hits

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Copy the leading verified pages of ``keys`` into the host slots ``host_indices``
        (``len(keys) * page_size`` of them); ``True`` for each page restored."""
        out = [False] * len(keys)
        if not keys or not self.settings.load:
            return out
        t0 = time.perf_counter()
        try:
            cache, geo, buffer = self._ready()
            slots = page_slots(host_indices, len(keys), geo.page_tokens)
            xkeys = store_keys(self.namespace, keys)
            prefix = self._prefix.of(self.namespace, extra_info, xkeys)
            pos, end = 0, len(keys)
            tier = leasing_tier(cache)
            remote = remote_tier(cache)
            if tier is not None:
                # Pages the in-process cpu tier holds: verified in place, one copy (arena.py).
                pos = read_leased(cache, tier, xkeys, geo.page_tokens,
                                  lambda i: page_view(geo, buffer, slots[i]))
                out[:pos] = [True] * pos
            elif remote is not None and places_alike(remote, xkeys, prefix):
                # A kvtier-server first: verified where the data path put it, one copy (remote.py);
                # with no tier below it, its first miss ends the read.
                pos = read_visited(cache, remote, xkeys, geo.page_tokens,
                                   lambda i: page_view(geo, buffer, slots[i]))
                out[:pos] = [True] * pos
                end = pos if len(cache.store.tiers) == 1 else end
            if pos < end:
                # Batches read into this thread's buffers and verified there, the next batch
                # read while this one is copied (one strided copy per page) into the pool
                # (readahead.py). A missing or refused page ends the leading run.
                def load(first: int, batch: Sequence[memoryview]) -> VerifiedRun:
                    return cache.load_verified_into(xkeys[first:first + len(batch)],
                                                    [(0, geo.page_tokens)] * len(batch), batch, first,
                                                    prefix)

                def copy(i: int, payload: Buf) -> None:
                    load_page(page_view(geo, buffer, slots[i]), payload)
                    out[i] = True

                bufs = self._thread_buffers()
                read_ahead(load, copy, pos, end, bufs.sets(end - pos), self._io.pool())
        except Exception as exc:  # never into SGLang's threads: see _EXPECTED
            self._fail("get", len(keys), exc)
        done = sum(out)
        seconds, nbytes = time.perf_counter() - t0, done * (self._geo.page_bytes if self._geo else 0)
        self.stats.read(done, nbytes, seconds)
        if self.usage is not None:
            self.usage.on_get(len(keys), done, seconds, nbytes, store_keys(self.namespace, keys[:1])[0])
        self.stats.add("pages_missed", len(keys) - done)
        return out

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the host pages ``host_indices`` under ``keys``; pages already stored are not
        written again. ``True`` for each page stored (or owned by another writer rank)."""
        if not keys:
            return []
        if not self.settings.save or not self._writer:
            return [True] * len(keys)
        t0 = time.perf_counter()
        try:
            cache, geo, buffer = self._ready()
            slots = page_slots(host_indices, len(keys), geo.page_tokens)
            xkeys = store_keys(self.namespace, keys)
            prefix = self._prefix.of(self.namespace, extra_info, xkeys)
            present = cache.store.lookup(xkeys, prefix=prefix).hits
            depth0 = len(prefix) - len(keys) if prefix is not None else 0
            parent = prefix[depth0 - 1] if prefix is not None and depth0 else b""
            views = [page_view(geo, buffer, s) for s in slots[present:]]
            accepted = self._store_pages(cache, geo, views, xkeys, present, depth0, parent, prefix)
        except Exception as exc:  # never into SGLang's threads: see _EXPECTED
            self._fail("set", len(keys), exc)
            if self.usage is not None:
                self.usage.on_set_failed(len(keys))
            return [False] * len(keys)
        ok = accepted == len(keys) - present
        if not ok:
            self._fail("set", len(keys) - present - accepted, RuntimeError("the first tier refused pages"))
            if self.usage is not None:
                self.usage.on_set_failed(len(keys) - present)
        self.stats.add("pages_already_stored", present)
        self.stats.wrote(accepted, accepted * geo.page_bytes, time.perf_counter() - t0)
        return [True] * present + [ok] * (len(keys) - present)

    def _store_pages(self, cache: PrefixCache, geo: PageGeometry, views: list[torch.Tensor],
                     xkeys: list[bytes], first: int, depth0: int, parent0: bytes,
                     prefix: Sequence[bytes] | None) -> int:
        """Store pages ``first..`` (``views[j]`` is page ``first + j``) in batches, placed by
        ``prefix`` (prefix.py; None: by themselves); returns how many the first tier accepted.
        Raw codec: each page is copied once, straight from the pool into a chunk buffer, and
        framed there. The buffers are this thread's reusable ones
        when the store keeps no reference after ``store`` returns (tiers copy what they keep;
        only a write-through cascade queues the entries for the lower tiers), else fresh ones
        the store takes over. Other codecs compress from a reused canonical scratch page."""
        if not views:
            return 0
        tier = writable_tier(cache)
        if tier is not None:
            # A single in-process cpu tier: each page is copied into its arena slot and framed
            # there (arena.py), no chunk buffer in between.
            keys = xkeys[first:first + len(views)]
            n = write_in_place(cache, tier, keys, geo.page_tokens, lambda j: views[j],
                               depth0 + first, xkeys[first - 1] if first else parent0)
            self._track(keys[:n])
            return n
        remote = filling_tier(cache)
        if remote is not None and places_alike(remote, xkeys[first:first + len(views)], prefix):
            # A single kvtier-server tier: each page is framed in the data path's shared
            # segment and sent at once (remote.py), no chunk buffer in between.
            keys = xkeys[first:first + len(views)]
            stored = write_filled(cache, remote, keys, geo.page_tokens, lambda j: views[j],
                                  depth0 + first, xkeys[first - 1] if first else parent0)
            self._track([k for k, ok in zip(keys, stored) if ok])
            return sum(stored)
        store = cache.store
        raw = cache.codec == Codec.RAW and not cache.shuffle
        reuse = raw and not (len(store.tiers) > 1 and store.config.write_policy == "write_through")
        bufs = self._thread_buffers()
        shape = cache.spec.layout.chunk_shape(geo.page_tokens)

        def fill(start: int, n: int, which: int) -> list[Entry]:
            """Pages ``first + start`` on, framed in buffer set ``which`` (or fresh buffers)."""
            if reuse:
                batch = bufs.batch(n, which)
            else:
                batch = [page_aligned_buffer(HEADER_SIZE + geo.page_bytes) for _ in range(n if raw else 0)]
            entries = []
            for k in range(n):
                i = first + start + k
                src = views[start + k]
                if raw:  # a buffer the store's write takes at once: ordinary stores leave it in cache
                    data = memoryview(batch[k])[:HEADER_SIZE + geo.page_bytes]
                    page_framer(cache, xkeys[i], src, geo.page_tokens, streaming=False)(data)
                else:
                    scratch = self._scratch_page(geo.page_bytes)
                    save_page(src, scratch)
                    data = encode_chunk(self.namespace, xkeys[i], cache.spec.kv_dtype, shape,
                                        scratch, codec=cache.codec, shuffle=cache.shuffle)
                entries.append(Entry(xkeys[i], data, depth0 + i, xkeys[i - 1] if i else parent0))
            self._track([e.key for e in entries])
            return entries

        # Each batch stored on an I/O thread while the next is filled (writebehind.py).
        return write_behind(fill, partial(store.store, prefix=prefix), len(views), bufs.per_batch,
                            bufs.ring_sets, self._io.pool())

    def _track(self, keys: list[bytes]) -> None:
        self.stats.add("untracked_pages", self._written.add(keys))

    def _scratch_page(self, nbytes: int) -> bytearray:
        page = getattr(self._local, "page", None)
        if page is None or len(page) != nbytes:
            page = self._local.page = bytearray(nbytes)
        return page

    # --- lifecycle, stats ------------------------------------------------------------------------
    def clear(self) -> None:
        """Delete the pages this backend stored. Pages other processes or engines stored in a
        shared tier stay: one client of a shared cache must not wipe everyone's prefixes."""
        keys = self._written.take_all()
        if self._store is not None and keys:
            self._store.delete(keys)
        log.info("kvtier_sglang: cleared %d pages", len(keys))

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the calls since the previous call (the metrics
        collector logs it when ``--enable-cache-report``/storage metrics are on)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        iv = self.stats.take_interval()
        return StorageMetrics(prefetch_pgs=iv.prefetch_pgs, backup_pgs=iv.backup_pgs,
                              prefetch_bandwidth=iv.prefetch_bandwidth,
                              backup_bandwidth=iv.backup_bandwidth)

    def kvtier_stats(self) -> dict[str, Any]:
        """Counters since start (pages, bytes, per-verb errors) and each tier's usage."""
        out: dict[str, Any] = dict(self.stats.snapshot())
        if self._store is not None:
            out["tiers"] = self._store.stats()
        return out

    def close(self) -> None:
        """Flush and close the store this backend opened (idempotent)."""
        if self.usage is not None:
            self.usage.close()
        self._io.close()  # a read or store in flight ends before the store closes
        if self._store is not None and self._owns_store:
            self._store.close()
