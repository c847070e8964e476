"""KV events for prefix-aware routers: which of this engine's blocks kvtier holds, per tier.

vLLM publishes ``BlockStored`` / ``BlockRemoved`` for its own GPU blocks; with
``--kv-events-config '{"enable_kv_cache_events":true,...}'`` it also publishes what the
connector's ``take_events`` returns, in the same batches. kvtier's events follow vLLM's own
offloading connector (``offloading/events.py``, "self-describing" mode):

- ``block_hashes`` are vLLM's own block hashes of the chunk's blocks (``block_size`` =
  vLLM's hash block size, ``token_ids`` = the chunk's tokens, ``parent_block_hash`` = the hash
  of the block before the chunk), so a router that already indexes this engine's GPU blocks
  scores kvtier-held blocks under the same hashes. A request without vLLM block hashes
  (prefix caching off) is described by kvtier's chunk keys instead (``block_size`` = chunk
  tokens, parent = the previous chunk's key): still self-describing.
- ``medium`` is vLLM's: ``CPU`` for kvtier's RAM tiers, ``STORAGE`` for disk, redis and
  kvtier-server (``locality`` ``LOCAL`` or ``REMOTE``), and ``ownership`` names the kvtier
  tier (``kvtier:cpu``, ``kvtier:disk``, ``kvtier:redis``, ``kvtier:grpc``).
- A chunk the tracker cannot describe (its request's snapshot was pushed out of the bounded
  tracker, or it was promoted before any lookup described it) gets vLLM's placeholder shape:
  the kvtier key as its one hash, no tokens, ``block_size`` 0.

Path: the worker's store tells :class:`WorkerEvents` (a ``kvtier.store.StoreListener``) each
put and eviction per tier; rank 0 ships them with the key bindings of the step's lookups and
saves in its worker metadata; the scheduler's :class:`EventTracker` turns them into vLLM
events, using the per-chunk snapshots it took while the request was alive. Both queues are
bounded: beyond the bound events are dropped and counted (``events_dropped``), never blocking
a tier or the engine. Only rank 0 reports (every TP rank stores its own shard under its own
keys, so one rank's view stands for the prefix).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvtier.cache import PrefixCache
from kvtier.tiers.base import Entry

from .partial import partial_key

log = logging.getLogger(__name__)

# kvtier tier name -> (vLLM medium, locality). Unknown tiers: STORAGE, unspecified locality.
_MEDIA: dict[str, tuple[str, str | None]] = {
    "cpu": ("CPU", "LOCAL"), "memory": ("CPU", "LOCAL"), "gpu": ("GPU", "LOCAL"),
    "disk": ("STORAGE", "LOCAL"), "redis": ("STORAGE", "REMOTE"), "grpc": ("STORAGE", "REMOTE"),
}


def medium_of(tier: str) -> tuple[str, str | None, str]:
    """(vLLM medium, locality, ownership) of a kvtier tier."""
    medium, locality = _MEDIA.get(tier, ("STORAGE", None))
    return medium, locality, f"kvtier:{tier}"


@dataclass
class TierEvent:
    """Worker -> scheduler: ``tier`` took (``stored``) or lost ``keys``."""

    stored: bool
    tier: str
    keys: list[bytes]


@dataclass
class KeyBinding:
    """Worker -> scheduler: request ``req_id``'s chunk ``first_chunk + i`` has key ``keys[i]``;
    ``parent`` is the key of chunk ``first_chunk - 1`` (b"" for chunk 0)."""

    req_id: str
    first_chunk: int
    keys: list[bytes]
    parent: bytes = b""


@dataclass
class EventBatch:
    events: list[TierEvent] = field(default_factory=list)
    bindings: list[KeyBinding] = field(default_factory=list)
    dropped: int = 0

    def __bool__(self) -> bool:
        return bool(self.events or self.bindings or self.dropped)


class SaveLike(Protocol):
    """What :meth:`WorkerEvents.bind_saves` reads of a ``protocol.SaveSpec`` (protocol.py
    imports this module, so the type is structural here)."""

    @property
    def req_id(self) -> str: ...
    @property
    def salt(self) -> bytes: ...
    @property
    def tokens(self) -> bytes: ...
    @property
    def start_chunk(self) -> int: ...
    @property
    def end_chunk(self) -> int: ...
    @property
    def partial(self) -> bool: ...


class WorkerEvents:
    """The worker store's listener: a bounded buffer of tier events and key bindings until the
    next step's worker metadata drains it. Thread-safe (saver, writer, prefetch, lookup and
    forward threads all feed it); never raises into a tier; beyond ``max_keys`` buffered keys
    new events are dropped and counted."""

    def __init__(self, max_keys: int, on_drop: Callable[[int], None] | None = None) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self._max = max_keys
        self._on_drop = on_drop
        self._lock = threading.Lock()
        self._batch = EventBatch()
        self._keys = 0
        self._muted: OrderedDict[bytes, None] = OrderedDict()  # partial chunks (bounded, LRU)

    # --- StoreListener -------------------------------------------------------------------------
    def chunks_stored(self, tier: str, entries: Sequence[Entry]) -> None:
        self._add(True, tier, [e.key for e in entries])

    def chunks_removed(self, tier: str, keys: Sequence[bytes]) -> None:
        self._add(False, tier, list(keys))

    def mute(self, key: bytes) -> None:
        """Never announce ``key``: a partial chunk (partial.py) covers fewer blocks than a chunk
        and no snapshot describes it; vLLM's own events already name those blocks."""
        with self._lock:
            self._muted[key] = None
            self._muted.move_to_end(key)
            while len(self._muted) > self._max:
                self._muted.popitem(last=False)

    def _add(self, stored: bool, tier: str, keys: list[bytes]) -> None:
        with self._lock:
            if self._muted:
                keys = [k for k in keys if k not in self._muted]
                if not keys:
                    return
            if self._keys + len(keys) > self._max:
                self._batch.dropped += len(keys)
                dropped = len(keys)
            else:
                dropped = 0
                self._keys += len(keys)
                events = self._batch.events
                last = events[-1] if events else None
                if last is not None and last.stored == stored and last.tier == tier:
                    last.keys.extend(keys)  # one event per run (evictions come one by one)
                else:
                    events.append(TierEvent(stored, tier, keys))
        if dropped and self._on_drop is not None:
            self._on_drop(dropped)

    # --- bindings (lookup and forward threads) --------------------------------------------------
    def bind(self, req_id: str, first_chunk: int, keys: Sequence[bytes], parent: bytes) -> None:
        """Record which keys a request's chunks have; call before the store can report them."""
        if not keys:
            return
        with self._lock:
            if self._keys + len(keys) > self._max:
                self._batch.dropped += len(keys)
                return
            self._keys += len(keys)
            self._batch.bindings.append(KeyBinding(req_id, first_chunk, list(keys), parent))

    def bind_request(self, req_id: str, cache: PrefixCache, tokens: np.ndarray, c0: int, c1: int) -> None:
        """Bind the keys of full chunks ``[c0, c1)`` of ``tokens`` (a lookup or a save of ``req_id``)."""
        keys = cache.keys(tokens[:c1 * cache.chunk_tokens], full_chunks_only=True)
        self.bind(req_id, c0, keys[c0:c1], keys[c0 - 1] if c0 else b"")

    def mute_partial(self, cache: PrefixCache, tokens: np.ndarray, end: int) -> None:
        """Mute the partial chunk of ``tokens`` ending at ``end`` (see :meth:`mute`)."""
        self.mute(partial_key(cache, tokens, end))

    def bind_saves(self, saves: Sequence[SaveLike], cache_for: Callable[[bytes], PrefixCache]) -> None:
        """Bind (or, for partial chunks, mute) the chunks this step's saves will put."""
        for spec in saves:
            tokens = np.frombuffer(spec.tokens, dtype="<u4")
            if spec.partial:
                self.mute_partial(cache_for(spec.salt), tokens, len(tokens))
            else:
                self.bind_request(spec.req_id, cache_for(spec.salt), tokens, spec.start_chunk, spec.end_chunk)

    def drain(self) -> EventBatch | None:
        with self._lock:
            batch, self._batch, self._keys = self._batch, EventBatch(), 0
        return batch if batch else None


@dataclass(slots=True)
class _ChunkInfo:
    """What describes one chunk: vLLM's block hashes of it (None: describe it by kvtier keys),
    the hash before it, its tokens (uint32-LE bytes) and the tiers known to hold it."""

    hashes: tuple[Any, ...] | None
    parent: Any
    tokens: bytes
    tiers: set[str] = field(default_factory=set)


class EventTracker:
    """Scheduler side (scheduler thread only): per-chunk snapshots taken while a request is
    alive, joined with the worker's key bindings, turned into vLLM ``BlockStored`` /
    ``BlockRemoved`` events. Both maps are LRU-bounded by ``max_chunks``; the outgoing list by
    ``max_events`` (beyond it events are dropped and counted)."""

    def __init__(self, chunk_tokens: int, hash_block_size: int, max_chunks: int, max_events: int,
                 on_drop: Callable[[int], None] | None = None) -> None:
        self.chunk = chunk_tokens
        self.hash_block = hash_block_size
        self.max_chunks = max_chunks
        self.max_events = max_events
        self._on_drop = on_drop
        self._pending: OrderedDict[tuple[str, int], _ChunkInfo] = OrderedDict()
        self._by_key: OrderedDict[bytes, _ChunkInfo] = OrderedDict()
        self._out: list[Any] = []
        self.dropped = 0

    def snapshot(self, request: Any, first_chunk: int, end_chunk: int) -> None:
        """Describe chunks ``[first_chunk, end_chunk)`` of ``request`` for later events."""
        c = self.chunk
        per = c // self.hash_block if self.hash_block and c % self.hash_block == 0 else 0
        hashes = list(getattr(request, "block_hashes", None) or ())
        toks = request.all_token_ids
        for idx in range(first_chunk, end_chunk):
            mine: tuple[Any, ...] | None = None
            parent: Any = None
            if per and len(hashes) >= (idx + 1) * per:
                mine = tuple(hashes[idx * per:(idx + 1) * per])
                parent = hashes[idx * per - 1] if idx else None
            info = _ChunkInfo(mine, parent, np.asarray(toks[idx * c:(idx + 1) * c], dtype="<u4").tobytes())
            self._pending[(request.request_id, idx)] = info
            self._pending.move_to_end((request.request_id, idx))
        while len(self._pending) > self.max_chunks:
            self._pending.popitem(last=False)

    def feed(self, batch: EventBatch) -> None:
        """Apply a worker batch: bindings first (they were taken before the puts they name)."""
        if batch.dropped:
            self._drop(batch.dropped)
        for b in batch.bindings:
            for i, key in enumerate(b.keys):
                info = self._pending.pop((b.req_id, b.first_chunk + i), None)
                if info is None:
                    continue
                if info.hashes is None:  # described by kvtier keys: the parent is a key too
                    info.parent = b.keys[i - 1] if i else (b.parent or None)
                old = self._by_key.pop(key, None)
                if old is not None:
                    info.tiers |= old.tiers
                self._by_key[key] = info
        while len(self._by_key) > self.max_chunks:
            self._by_key.popitem(last=False)
        for ev in batch.events:
            self._emit(ev)

    def _emit(self, ev: TierEvent) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        def conv(h: Any) -> Any:  # ints when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (0.32's default)
            return maybe_convert_block_hash(h)

        medium, locality, owner = medium_of(ev.tier)
        out: list[Any] = []
        if not ev.stored:
            hashes: list[Any] = []
            for key in ev.keys:
                info = self._by_key.get(key)
                if info is None:
                    hashes.append(conv(key))
                    continue
                if info.hashes is not None:
                    hashes.extend(conv(h) for h in info.hashes)
                else:
                    hashes.append(conv(key))
                info.tiers.discard(ev.tier)
                if not info.tiers:
                    del self._by_key[key]
            out.append(_make(BlockRemoved, block_hashes=hashes, medium=medium, locality=locality,
                             ownership=owner))
        for key in ev.keys if ev.stored else ():
            info = self._by_key.get(key)
            if info is None:  # vLLM's placeholder shape: nothing but the key
                out.append(_make(BlockStored, block_hashes=[conv(key)], parent_block_hash=None, token_ids=[],
                                 block_size=0, lora_id=None, medium=medium, lora_name=None,
                                 locality=locality, ownership=owner))
                continue
            self._by_key.move_to_end(key)
            info.tiers.add(ev.tier)
            toks = np.frombuffer(info.tokens, dtype="<u4").tolist()
            parent = conv(info.parent) if info.parent is not None else None
            if info.hashes is not None:
                hashes, size = [conv(h) for h in info.hashes], self.hash_block
            else:
                hashes, size = [conv(key)], self.chunk
            out.append(_make(BlockStored, block_hashes=hashes, parent_block_hash=parent, token_ids=toks,
                             block_size=size, lora_id=None, medium=medium, lora_name=None,
                             locality=locality, ownership=owner))
        room = self.max_events - len(self._out)
        if len(out) > room:
            self._drop(len(out) - max(room, 0))
            out = out[:max(room, 0)]
        self._out.extend(out)

    def _drop(self, n: int) -> None:
        self.dropped += n
        if self._on_drop is not None:
            self._on_drop(n)

    def take(self) -> list[Any]:
        out, self._out = self._out, []
        return out


def _make(cls: Any, **fields: Any) -> Any:
    """``cls(**fields)`` without the fields this vLLM's event struct lacks (``locality`` and
    ``ownership`` are 0.32's; older and newer structs differ in such optional fields)."""
    known = getattr(cls, "__struct_fields__", None)
    return cls(**({k: v for k, v in fields.items() if k in known} if known else fields))
