"""PrefixCache: the namespace-bound face of the store that engine connectors use.

It turns token ids into chained chunk keys, K/V payload bytes into self-describing chunks and
back, and refuses any chunk whose namespace, key, dtype, shape or checksum is not exactly what
this engine would compute (a wrong chunk is a wrong answer). Payload layout of a chunk:
``(layers, kv, tokens, kv_heads, head_dim)``, C-contiguous, in ``spec.kv_dtype``.

Key schemas (docs/keys.md): ``v1`` chains tokens per chunk (a trailing partial chunk is keyed
too); ``x1`` keys each full chunk by the engine-neutral page chain SGLang computes
(``kvtier.keys.xengine_keys``; a chunk is one page, a partial page is never keyed), so chunks
written by one engine's connector are found by another's.

Engine-agnostic: payloads are bytes-like (numpy/torch conversion happens in connectors).
Threads: safe to call from any thread (the store is); ``save`` may run on an engine thread
since the store never blocks on lower tiers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.chunk import (
    HEADER_SIZE,
    Shape,
    decode_chunk,
    dtype_itemsize,
    encode_chunk,
    frame_raw_chunk,
)
from kvtier.codec import Buf, Codec
from kvtier.config import KVTierConfig
from kvtier.errors import ChunkError, ConfigError
from kvtier.keys import KEY_BYTES, NamespaceSpec, chunk_keys, chunk_spans, xengine_keys
from kvtier.metrics import Metrics
from kvtier.store import Promotion, TieredStore
from kvtier.tiers.base import ABSENT, Entry

log = logging.getLogger(__name__)

Tokens = Sequence[int] | np.ndarray
KEY_SCHEMAS = ("v1", "x1")


@dataclass(frozen=True)
class PrefixHit:
    tokens: int
    chunks: int
    per_tier: dict[str, int] = field(default_factory=dict)
    reason: str = ABSENT
    runs: tuple[tuple[str, int], ...] = ()  # (tier, chunks) in prefix order


@dataclass(frozen=True)
class LoadedPrefix:
    """``payloads[i]`` holds chunk i's raw K/V bytes of shape ``shapes[i]``; ``tokens`` is the
    number of prompt tokens they cover (0 on a miss)."""

    tokens: int
    payloads: list[Buf]
    shapes: list[Shape]
    per_tier: dict[str, int] = field(default_factory=dict)
    reason: str = ABSENT


@dataclass(frozen=True)
class VerifiedRun:
    """The leading run of verified chunk payloads of a key range, and why it stopped."""

    payloads: list[Buf]
    shapes: list[Shape]
    per_tier: dict[str, int]
    reason: str
    nbytes: int
    # What a deferred-promotion load left to promote (see PrefixCache.promote); empty otherwise.
    promotion: Promotion = Promotion()


class PrefixCache:
    def __init__(self, store: TieredStore, spec: NamespaceSpec, *, codec: str | Codec = "raw",
                 shuffle: bool = False, tenant: str = "", key_schema: str = "v1",
                 page_seed: bytes | None = None) -> None:
        """``key_schema``: ``v1`` or ``x1`` (module docstring). ``page_seed`` (x1 only): the
        request's page-chain seed, ``kvtier.keys.page_hash_seed(extra_key, cache_salt)``;
        None is the shared chain. ConfigError for an unknown schema, x1 with a non-SHA-256
        namespace (SGLang's namespace is SHA-256) or a seed without x1."""
        if key_schema not in KEY_SCHEMAS:
            raise ConfigError(f"key_schema: {key_schema!r} is not one of {KEY_SCHEMAS}")
        if key_schema == "x1" and spec.hash_name != "sha256":
            raise ConfigError(f"hash: key_schema x1 needs a sha256 namespace, got {spec.hash_name!r}")
        if page_seed is not None and (key_schema != "x1" or len(page_seed) != KEY_BYTES):
            raise ConfigError(f"page_seed: a {KEY_BYTES}-byte seed of the x1 page chain "
                              f"(key_schema {key_schema!r}, {len(page_seed)} bytes given)")
        self.store = store
        self.spec = spec
        self.key_schema = key_schema
        self.page_seed = page_seed
        self.namespace = spec.namespace_id()
        self.codec = Codec.parse(codec)
        self.shuffle = shuffle
        self.tenant = tenant
        self.metrics: Metrics = store.metrics
        self._tenant_label = self.metrics.declare_tenant(tenant, tuple(t.name for t in store.tiers))
        # This tenant's lookup series, resolved once (labels() costs ~1-2 us a call, and a
        # lookup counts one per tier run): the label value is fixed for this cache's life.
        self._lookups = self.metrics.lookups.labels(self._tenant_label)
        self._hit_tokens = {t.name: self.metrics.hit_tokens.labels(t.name, self._tenant_label)
                            for t in store.tiers}
        self._check_slot_sizes()

    @classmethod
    def open(cls, cfg: KVTierConfig, spec: NamespaceSpec, metrics: Metrics | None = None) -> PrefixCache:
        """Build the store from ``cfg`` (tiers, write policy) and bind it to ``spec``; the
        config's ``salt_hex`` salts the namespace unless ``spec`` carries a salt already."""
        if cfg.salt and not spec.salt:
            spec = dataclasses.replace(spec, salt=cfg.salt)
        return cls(TieredStore.from_config(cfg, metrics), spec, codec=cfg.codec,
                   shuffle=cfg.shuffle, tenant=cfg.tenant, key_schema=cfg.key_schema)

    @property
    def chunk_tokens(self) -> int:
        return self.spec.layout.chunk_tokens

    def keys(self, tokens: Tokens, *, full_chunks_only: bool = False) -> list[bytes]:
        """Chunk keys of ``tokens`` under this cache's schema (x1: full chunks only, always)."""
        if self.key_schema == "x1":
            return xengine_keys(self.namespace, tokens, self.chunk_tokens, self.page_seed)
        return chunk_keys(self.namespace, tokens, self.chunk_tokens, self.spec.hash_name,
                          include_partial=not full_chunks_only)

    def spans(self, num_tokens: int, *, full_chunks_only: bool = False) -> list[tuple[int, int]]:
        """[start, end) token span of each key :meth:`keys` returns for ``num_tokens`` tokens."""
        return chunk_spans(self._covered(num_tokens, full_chunks_only), self.chunk_tokens)

    def lookup(self, tokens: Tokens, *, full_chunks_only: bool = False) -> PrefixHit:
        keys = self.keys(tokens, full_chunks_only=full_chunks_only)
        res = self.store.lookup(keys, prefix=keys)
        # Token counts by arithmetic on the spans :meth:`spans` would list (chunk i covers
        # [i*C, min((i+1)*C, covered))): no 512-tuple list on the lookup path.
        c, covered = self.chunk_tokens, self._covered(len(tokens), full_chunks_only)
        hit_tokens = min(res.hits * c, covered)
        self._count(res.runs, hit_tokens, len(tokens), res.reason, covered)
        return PrefixHit(hit_tokens, res.hits, res.per_tier, res.reason, res.runs)

    def _covered(self, num_tokens: int, full_chunks_only: bool) -> int:
        """How many leading tokens :meth:`keys` keys: the end of the last span of :meth:`spans`."""
        partial = not full_chunks_only and self.key_schema == "v1"
        return num_tokens if partial else num_tokens - num_tokens % self.chunk_tokens

    def load(self, tokens: Tokens, *, max_tokens: int | None = None,
             full_chunks_only: bool = False) -> LoadedPrefix:
        """Load and verify the leading cached chunks (at most ``max_tokens`` tokens' worth)."""
        keys = self.keys(tokens, full_chunks_only=full_chunks_only)
        spans = self.spans(len(tokens), full_chunks_only=full_chunks_only)
        if max_tokens is not None:
            n = sum(1 for _, end in spans if end <= max_tokens)
            keys, spans = keys[:n], spans[:n]
        run = self.load_verified(keys, spans, prefix=keys)
        hit_tokens = spans[len(run.payloads) - 1][1] if run.payloads else 0
        return LoadedPrefix(hit_tokens, run.payloads, run.shapes, run.per_tier, run.reason)

    def load_verified(self, keys: Sequence[bytes], spans: Sequence[tuple[int, int]],
                      first_index: int = 0, prefix: Sequence[bytes] | None = None) -> VerifiedRun:
        """Load ``keys`` (chunks ``first_index``.. of one prefix, token ``spans`` each) and verify
        every chunk; the first bad one is deleted from every tier (so it is recomputed and saved
        again), counted, and ends the run. ``prefix``: the whole prefix's keys from chunk 0
        (where a prefix-placed tier looks; see TieredStore.lookup). Never raises for store trouble."""
        res = self.store.load(keys, prefix=prefix)
        return self._verify(keys, spans, res.chunks, res.sources, res.reason, first_index, prefix)

    def load_verified_into(self, keys: Sequence[bytes], spans: Sequence[tuple[int, int]],
                           outs: Sequence[memoryview], first_index: int = 0,
                           prefix: Sequence[bytes] | None = None, *,
                           defer_promotion: bool = False) -> VerifiedRun:
        """:meth:`load_verified` into caller-owned buffers (one per key, each large enough for
        its chunk; page-aligned for O_DIRECT reads): the payloads returned are views of
        ``outs``, valid while the caller leaves those buffers alone. ``defer_promotion``: the
        chunks from lower tiers are promoted only when the caller calls :meth:`promote` (before
        reusing ``outs``), so a caller waiting for the bytes does not wait for the copies up."""
        res = self.store.load_into(keys, outs, prefix=prefix, defer_promotion=defer_promotion)
        run = self._verify(keys, spans, res.chunks, res.sources, res.reason, first_index, prefix)
        return dataclasses.replace(run, promotion=res.promotion) if defer_promotion else run

    def promote(self, run: VerifiedRun) -> None:
        """Promote the verified chunks of a deferred-promotion ``run`` (never a refused one)."""
        self.store.promote(run.promotion, len(run.payloads))

    def _verify(self, keys: Sequence[bytes], spans: Sequence[tuple[int, int]], chunks: Sequence[Buf],
                sources: Sequence[str], reason: str, first_index: int,
                prefix: Sequence[bytes] | None) -> VerifiedRun:
        payloads: list[Buf] = []
        shapes: list[Shape] = []
        nbytes = 0
        for i, data in enumerate(chunks):
            start, end = spans[i]
            shape = self.spec.layout.chunk_shape(end - start)
            try:
                chunk = decode_chunk(data, namespace=self.namespace, key=keys[i],
                                     dtype=self.spec.kv_dtype, shape=shape)
            except ChunkError as exc:
                log.warning("refusing chunk %d (%s): %s", first_index + i, keys[i].hex()[:16], exc)
                self.metrics.chunk_errors.labels(exc.reason).inc()
                self.store.delete(keys[i:i + 1], prefix)  # where the load found it
                reason = exc.reason
                break
            payloads.append(chunk.payload)
            shapes.append(shape)
            nbytes += len(data)
        per_tier: dict[str, int] = {}
        for name in sources[: len(payloads)]:
            per_tier[name] = per_tier.get(name, 0) + 1
        return VerifiedRun(payloads, shapes, per_tier,
                           reason if len(payloads) < len(keys) else ABSENT, nbytes)

    def save(self, tokens: Tokens, payload_for: Callable[[int, int], Buf], *,
             start_chunk: int = 0, full_chunks_only: bool = False) -> int:
        """Store every chunk of ``tokens`` from ``start_chunk`` on that is not cached yet.

        ``payload_for(start, end)`` must return the raw K/V bytes of tokens [start, end) in
        chunk layout; it is called only for chunks that are missing. Returns #chunks stored.
        """
        keys = self.keys(tokens, full_chunks_only=full_chunks_only)
        spans = self.spans(len(tokens), full_chunks_only=full_chunks_only)
        first = max(start_chunk, self.store.lookup(keys, prefix=keys).hits)
        entries: list[Entry] = []
        for i in range(first, len(keys)):
            start, end = spans[i]
            entries.append(self._entry(keys, i, self.spec.layout.chunk_shape(end - start), payload_for(start, end)))
        return self.store.store(entries, prefix=keys)

    def store_chunks(self, keys: Sequence[bytes], chunks: Sequence[int], payload: Callable[[int], Buf],
                     *, skip_held: bool = True, framed: bool = False) -> int:
        """Store the full chunks ``chunks`` (ascending indexes into ``keys``, the prefix's
        full-chunk keys from chunk 0, as :meth:`keys` gives them); ``payload(i)`` returns chunk
        ``i``'s raw K/V bytes. ``skip_held``: first ask the store how many leading chunks it
        holds and skip those (as :meth:`save` does); False for a caller that knows they are
        missing (kvtier_vllm's capture probed every tier just before): no lookup, no rehash.
        ``framed``: ``payload(i)`` is a writable buffer of ``HEADER_SIZE`` bytes + the raw K/V
        bytes (the caller left room for the header). When :meth:`frames_in_place`, the header
        is written into that room and the buffer itself is stored (no copy, no allocation), so
        the caller may reuse it only once this returns; else it is encoded as usual.
        Returns #chunks stored."""
        if not chunks:
            return 0
        prefix = keys[:chunks[-1] + 1]
        first = self.store.lookup(prefix, prefix=prefix).hits if skip_held else 0
        shape = self.spec.layout.chunk_shape(self.chunk_tokens)
        if framed and self.frames_in_place():
            kv_dtype = self.spec.kv_dtype
            entries = [Entry(keys[i], frame_raw_chunk(memoryview(payload(i)).cast("B"), self.namespace, keys[i],
                                                      kv_dtype, shape), i, keys[i - 1] if i else b"")
                       for i in chunks if i >= first]
        else:
            entries = [self._entry(keys, i, shape, memoryview(payload(i)).cast("B")[HEADER_SIZE:] if framed
                                   else payload(i)) for i in chunks if i >= first]
        return self.store.store(entries, prefix=prefix)

    def frames_in_place(self) -> bool:
        """Whether :meth:`store_chunks` stores a ``framed`` payload's own buffer: the raw
        codec (the stored bytes are the payload) and a store that holds no entry after
        ``store`` returns (:attr:`TieredStore.keeps_entries`)."""
        return self.codec == Codec.RAW and not self.shuffle and not self.store.keeps_entries

    def _entry(self, keys: Sequence[bytes], i: int, shape: Shape, raw: Buf) -> Entry:
        """Chunk ``i`` of the prefix named by ``keys``, encoded, as the store takes it."""
        data = encode_chunk(self.namespace, keys[i], self.spec.kv_dtype, shape, raw,
                            codec=self.codec, shuffle=self.shuffle)
        return Entry(keys[i], data, i, keys[i - 1] if i else b"")

    def close(self) -> None:
        self.store.close()

    def _check_slot_sizes(self) -> None:
        """A chunk larger than a tier's fixed slot can never be stored there: refuse raw-codec
        setups that would silently store nothing, warn where compression might still fit."""
        lay = self.spec.layout
        need = HEADER_SIZE + math.prod(lay.chunk_shape(lay.chunk_tokens)) * dtype_itemsize(self.spec.kv_dtype)
        for tier in self.store.tiers:
            slot = getattr(tier, "slot_bytes", None)
            if slot is None or need <= slot:
                continue
            msg = (f"{tier.name}.slot_bytes: {slot} bytes is smaller than one chunk of this model "
                   f"({need} bytes for chunk_tokens={lay.chunk_tokens}); raise slot_bytes or lower chunk_tokens")
            if self.codec == Codec.RAW:
                raise ConfigError(msg)
            log.warning("%s (compressed chunks may still fit)", msg)

    def _count(self, runs: tuple[tuple[str, int], ...], hit_tokens: int, total: int, reason: str,
               covered: int) -> None:
        """Count a lookup: each run's tokens (chunks [pos, pos + n) cover tokens
        [pos*C, min((pos + n)*C, covered))) and the tokens missed."""
        m, tenant, c = self.metrics, self._tenant_label, self.chunk_tokens
        self._lookups.inc()
        pos = 0
        for name, n in runs:
            self._hit_tokens[name].inc(min((pos + n) * c, covered) - pos * c)
            pos += n
        if total > hit_tokens:
            m.miss_tokens.labels(reason, tenant).inc(total - hit_tokens)

