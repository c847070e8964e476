"""Scheduler half: lookup (through the workers), load/save planning, request lifecycle.

Runs in vLLM's EngineCore process, on the scheduler thread only (vLLM calls it from there).
It owns no store: the store lives in the workers, which answer lookups over a private socket
(``ipc.py``) and start a prefetch at the same moment. A lookup that fails or times out is a
miss; nothing here raises into the engine.

Per request it tracks: the lookup answer (cached for ``lookup_cache_s``), the planned load
(whole engine blocks, never the last prompt token), ``saved_upto`` (tokens whose chunks are
already stored or handed over), whether an async load is in flight (then ``request_finished``
keeps the blocks until the worker reports ``finished_recving``) and what was restored.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvtier.config import KVTierConfig

from .events import EventTracker
from .ipc import LookupClient, socket_path
from .partial import agree_on_hit, partial_save_ends
from .protocol import STEPS_REMEMBERED, KVTierMetadata, KVTierWorkerMeta, LoadSpec, SaveSpec
from .request_state import LookupMatch, RequestState
from .settings import VllmSettings, request_salt
from .stats import KVTierStats, StatsCollector
from .usage import SchedulerUsage

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

FAST_TIERS = frozenset({"cpu", "memory", "gpu"})


class SchedulerSide:
    def __init__(self, cfg: KVTierConfig, settings: VllmSettings, *, block_size: int,
                 engine_id: str, dp_rank: int, world_size: int, kv_events: bool,
                 hash_block_size: int | None = None,
                 model: str = "") -> None:
        self.cfg = cfg
        self.settings = settings
        self.block_size = block_size
        self.chunk = cfg.chunk_tokens
        self.kv_events = kv_events
        self._clients = [
            LookupClient(socket_path(engine_id, dp_rank, r, settings.socket_dir),
                         settings.lookup_timeout_s)
            for r in range(world_size)
        ]
        self._reqs: dict[str, RequestState] = {}
        self._pending: set[str] = set()  # requests with a planned load not yet sent
        self._dropped: list[str] = []
        self._skipped = 0  # skipped tokens committed since the last metadata
        self._step = 0
        # Per recent step, what its saves moved: request -> (saved_upto before the step, the
        # partial ends it planned), so a step whose saves a worker dropped is planned again.
        self._step_saves: dict[int, dict[str, tuple[int, list[int]]]] = {}
        self._purge: list[int] = []  # failed steps the workers are still to purge
        self.stats = StatsCollector()
        # KV events (events.py): chunk descriptions taken while requests are alive.
        self.events = EventTracker(
            self.chunk, hash_block_size or block_size, settings.events_tracked_chunks,
            settings.events_queue_keys, on_drop=lambda n: self.stats.add(kv_events_dropped=n),
        ) if kv_events else None
        self.usage = SchedulerUsage(cfg, model, engine_id)  # engine usage reports (kvtier.usage)

    # --- lookup ---------------------------------------------------------------------------
    def _state(self, request: Request) -> RequestState:
        st = self._reqs.get(request.request_id)
        if st is None:
            salt = request_salt(self.cfg, request)
            st = self._reqs[request.request_id] = RequestState(request, salt or b"", opaque=salt is None)
        return st

    def on_new_request(self, request: Request) -> None:
        self._state(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        if not self.settings.load or st.opaque:
            return 0, False
        bs, c = self.block_size, self.chunk
        # vLLM must compute at least one token itself (it samples from its logits).
        limit = (request.num_tokens - 1) // bs * bs
        # Full chunks over the loadable run, and at least the run itself (partial chunks).
        covered = max(limit, min(request.num_tokens // c * c, -(-limit // c) * c))
        if limit - num_computed_tokens < bs or covered <= num_computed_tokens:
            return 0, False
        now = time.monotonic()
        m = st.match
        if m is None or m.start != num_computed_tokens or now - m.at > self.settings.lookup_cache_s:
            m = self._lookup(st, num_computed_tokens, limit, covered, now)
            st.match = m
        hit = m.usable - num_computed_tokens
        if hit < bs:
            return 0, False
        return hit, m.is_async

    def _lookup(self, st: RequestState, start: int, limit: int, covered: int, now: float) -> LookupMatch:
        req = st.request
        header = {"op": "lookup", "req": req.request_id, "salt": st.salt.hex(), "start": start,
                  "limit": limit, "prefetch": self.settings.prefetch}
        blob = st.tokens(covered)
        if self.events is not None:  # the worker binds these chunks' keys at this lookup
            self.events.snapshot(req, start // self.chunk, covered // self.chunk)
        replies: list[dict[str, Any]] = []
        tiers = dict[str, int]()
        skipped, load_s = 0, 0.0
        t0 = time.perf_counter()
        for client in self._clients:
            reply = client.call(header, blob)
            if reply is None or "error" in reply:
                replies = []
                break
            replies.append(reply)
            skipped = max(skipped, int(reply.get("skipped", 0)))
            load_s = max(load_s, float(reply.get("load_s", 0.0)))
            for tier, n in (reply.get("tiers") or {}).items():
                tiers[tier] = max(tiers.get(tier, 0), int(n))
        usable, partial_end = agree_on_hit(replies, limit, self.chunk)
        usable = usable // self.block_size * self.block_size
        log.debug("kvtier: lookup of %s (%d tokens): %d usable, tiers %s, %.2f ms", req.request_id,
                  covered, usable, tiers, 1e3 * (time.perf_counter() - t0))
        mode = self.settings.async_load
        # A short load costs less inline than the extra engine steps an async one takes.
        is_async = mode == "always" or (mode == "auto" and not set(tiers) <= FAST_TIERS
                                        and load_s >= self.settings.async_min_load_s)
        self.stats.add(lookups=1)
        if usable > start:
            self.stats.add(lookup_hit_tokens=usable - start)
        return LookupMatch(start, max(start, usable), tiers, is_async, now,
                           partial_end if usable == partial_end else 0, skipped if replies else 0)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        st = self._reqs.get(request.request_id)
        if num_external_tokens <= 0 or st is None:
            return {}
        kinds = {"cpu": CacheHitSource.HOST, "memory": CacheHitSource.HOST,
                 "gpu": CacheHitSource.DEVICE, "disk": CacheHitSource.DISK}
        out: dict[Any, int] = {}
        left = num_external_tokens
        for tier, chunks in st.load_tiers.items():
            n = min(left, chunks * self.chunk)
            if n > 0:
                src = kinds.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
                out[src] = out.get(src, 0) + n
                left -= n
        if left > 0:
            out[CacheHitSource.EXTERNAL_UNSPECIFIED] = out.get(CacheHitSource.EXTERNAL_UNSPECIFIED, 0) + left
        return out

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._state(request)
        m = st.match
        if m is not None and m.skipped:
            st.skipped_tokens += m.skipped
            self._skipped += m.skipped
            self.stats.add(load_skipped_tokens=m.skipped)
        if num_external_tokens <= 0 or m is None:
            if m is not None and m.usable > m.start and not st.async_inflight:
                self._dropped.append(request.request_id)  # prefetched for nothing
            st.match = None
            return
        bs = self.block_size
        start, end = m.start, m.start + num_external_tokens
        ids = list(blocks.get_block_ids()[0][start // bs:end // bs])
        if len(ids) != (end - start) // bs or start % bs or end % bs:
            log.error("kvtier: block table of %s does not cover [%d, %d); not loading",
                      request.request_id, start, end)
            return
        covered = -(-end // self.chunk) * self.chunk
        # The run ends in the partial chunk the lookup found: load it, not a full chunk there.
        partial_end = m.partial_end if end > m.partial_end // self.chunk * self.chunk else 0
        if partial_end:
            covered = partial_end
        self._pending.add(request.request_id)
        st.pending = LoadSpec(request.request_id, st.salt, st.tokens(covered),
                              start, end, ids, m.is_async, partial_end)
        st.hit_tokens += num_external_tokens
        st.load_tiers = dict(m.tiers)
        for tier, n in m.tiers.items():
            st.hit_tiers[tier] = st.hit_tiers.get(tier, 0) + n
            self.stats.add_by("hit_tokens_by_tier", tier, n * self.chunk)
        st.match = None

    # --- per-step metadata ------------------------------------------------------------------
    def build_connector_meta(self, so: SchedulerOutput) -> KVTierMetadata:
        meta = KVTierMetadata()
        for req_id in self._pending:
            st = self._reqs.get(req_id)
            if st is not None and st.pending is not None:
                meta.loads.append(st.pending)
                st.async_inflight |= st.pending.is_async
                st.pending = None
        self._pending.clear()
        block_state = getattr(so, "kv_connector_block_state", None)
        self._track_blocks(so)
        for req_id in getattr(so, "preempted_req_ids", None) or ():
            gone = self._reqs.get(req_id)
            if gone is not None:
                gone.block_ids, gone.match, gone.seen = [], None, False
        self._step += 1
        meta.step = self._step
        meta.purge_steps, self._purge = self._purge, []
        if self.settings.save:
            marks: dict[str, tuple[int, list[int]]] = {}
            for req_id, n in so.num_scheduled_tokens.items():
                cur = self._reqs.get(req_id)
                if cur is not None:
                    before = cur.saved_upto
                    spec = self._plan_save(cur, n, block_state)
                    if spec is not None:
                        meta.saves.append(spec)
                    partials = self._plan_partials(cur, n, block_state)
                    meta.saves.extend(partials)
                    if spec is not None or partials:
                        marks[req_id] = (before, [len(p.tokens) // 4 for p in partials])
            if marks:
                self._step_saves[self._step] = marks
            while len(self._step_saves) > STEPS_REMEMBERED:
                del self._step_saves[next(iter(self._step_saves))]
        meta.dropped, self._dropped = self._dropped, []
        meta.skipped_tokens, self._skipped = self._skipped, 0
        meta.step_tokens = sum(so.num_scheduled_tokens.values())
        return meta

    def _track_blocks(self, so: SchedulerOutput) -> None:
        # Block tables as the workers see them; used when vLLM offers no KVConnectorBlockState.
        for new in so.scheduled_new_reqs:
            st: RequestState | None = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                if not st.seen:
                    st.seen = True
                    st.saved_upto = max(st.saved_upto, new.num_computed_tokens // self.chunk * self.chunk)
                    if not st.hit_tokens:
                        # Only vLLM's own prefix cache got here: a prefix other requests share,
                        # so its block-aligned tail is worth a partial chunk.
                        st.note_partial_end(new.num_computed_tokens, self.chunk, self.block_size)
        cached = so.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])

    def _plan_save(self, st: RequestState, n_sched: int, block_state: Any) -> SaveSpec | None:
        req, c = st.request, self.chunk
        if st.opaque:
            return None
        done = min(req.num_computed_tokens + n_sched, req.num_tokens)
        if not self.settings.save_decode:
            done = min(done, req.num_prompt_tokens)
        start_chunk, end_chunk = st.saved_upto // c, done // c
        if end_chunk <= start_chunk:
            return None
        ids = self._block_ids(st, block_state)
        bs = self.block_size
        lo, hi = start_chunk * c // bs, end_chunk * c // bs
        if len(ids) < hi:
            log.debug("kvtier: %s has %d blocks, save needs %d", req.request_id, len(ids), hi)
            return None
        st.saved_upto = end_chunk * c
        if self.events is not None:
            self.events.snapshot(req, start_chunk, end_chunk)
        return SaveSpec(req.request_id, st.salt, st.tokens(end_chunk * c),
                        start_chunk, end_chunk, ids[lo:hi])

    def _block_ids(self, st: RequestState, block_state: Any) -> list[int]:
        if block_state is not None:
            got = block_state.get_block_ids(st.request.request_id)
            if got:
                return list(got[0])
        return st.block_ids

    def _plan_partials(self, st: RequestState, n_sched: int, block_state: Any) -> list[SaveSpec]:
        """Partial chunks (partial.py) of ``st`` computed by the end of this step: the prompt's
        block-aligned end and a local prefix-cache hit's end, each saved once."""
        if not self.settings.save_partial or st.opaque:
            return []
        req, c, bs = st.request, self.chunk, self.block_size
        done = min(req.num_computed_tokens + n_sched, req.num_prompt_tokens)
        if done >= req.num_prompt_tokens and not st.prompt_end_noted:
            st.prompt_end_noted = True
            st.note_partial_end(req.num_prompt_tokens // bs * bs, c, bs)
        if not st.partial_ends:  # every decode step of most requests: nothing to do
            return []
        ends = [e for e in partial_save_ends(sorted(st.partial_ends), c, bs, done) if e not in st.partial_saved]
        if not ends:
            return []
        ids = self._block_ids(st, block_state)
        specs = []
        for e in ends:
            k = e // c
            if len(ids) < e // bs:
                continue
            st.partial_saved.add(e)
            st.partial_ends.discard(e)
            specs.append(SaveSpec(req.request_id, st.salt, st.tokens(e), k, k + 1,
                                  ids[k * c // bs:e // bs], partial=True))
        return specs

    # --- feedback and lifecycle -----------------------------------------------------------------
    def update_connector_output(self, out: KVConnectorOutput) -> None:
        for req_id in out.finished_recving or ():
            st = self._reqs.get(req_id)
            if st is not None:
                st.async_inflight = False
        self.usage.on_worker_stats(getattr(out, "kv_connector_stats", None))
        wm = getattr(out, "kv_connector_worker_meta", None)
        if not isinstance(wm, KVTierWorkerMeta):
            return
        for req_id, o in wm.loads.items():
            self.usage.on_outcome(o)
            st = self._reqs.get(req_id)
            if st is None:
                continue
            st.outcome = o
            if o.ok_end < o.end:
                # Re-save what vLLM now recomputes (the bad chunk was deleted from the store).
                st.saved_upto = min(st.saved_upto, o.ok_end // self.chunk * self.chunk)
                st.hit_tokens -= o.end - o.ok_end
        for step in wm.failed_steps:
            self._replan_saves(step)
            self._purge.append(step)
        if self.events is not None and wm.events is not None:
            self.events.feed(wm.events)

    def _replan_saves(self, step: int) -> None:
        """A worker dropped every save of ``step`` (a load in it fell short): plan them again,
        so the chunks vLLM now recomputes over good blocks are saved after all."""
        for req_id, (before, partial_ends) in self._step_saves.pop(step, {}).items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            st.saved_upto = min(st.saved_upto, before)
            for end in partial_ends:
                st.partial_saved.discard(end)
                st.partial_ends.add(end)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        self._dropped.append(request.request_id)
        params = {"kvtier": {
            "hit_tokens": st.hit_tokens,
            "hit_chunks_by_tier": dict(st.hit_tiers),
            "failed_tokens": (st.outcome.end - st.outcome.ok_end) if st.outcome else 0,
            "failure_reason": st.outcome.reason if st.outcome and st.outcome.ok_end < st.outcome.end else "",
            "saved_tokens": st.saved_upto,
            "skipped_tokens": st.skipped_tokens,
        }}
        failed = st.outcome is not None and st.outcome.ok_end < st.outcome.end
        self.usage.on_finished(int(getattr(request, "num_prompt_tokens", 0) or 0), st.hit_tokens,
                               st.hit_tiers, self.chunk, st.outcome.reason if st.outcome and failed else "")
        # An async load still writing into these blocks: vLLM frees them on finished_recving.
        return st.async_inflight, params

    def take_events(self) -> list[Any]:
        """vLLM's KV events for kvtier's tiers since the last call (events.py)."""
        if self.events is None:
            return []
        events = self.events.take()
        if events:
            self.stats.add(kv_events=len(events))
        return events

    def get_stats(self) -> KVTierStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        for client in self._clients:
            client.close()
        self.usage.close()
