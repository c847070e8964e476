"""KVTierHF: restore a cached prefix into a transformers DynamicCache and prefill only the rest.

    hf = KVTierHF(model, KVTierConfig.load("kvtier.yaml"))
    result = hf.generate(prompt_ids, max_new_tokens=32)   # restore -> prefill rest -> save -> decode
    result.tokens, result.restored_tokens, result.ttft_s

The namespace (see kvtier/keys.py) is derived from the model: model id and revision, the KV
dtype (the model's parameter dtype) and the layout (layers, KV heads, head dim, chunk tokens),
so a chunk saved by one model or layout is never served to another. Every chunk is verified
on load (kvtier/cache.py); a refused chunk ends the restored prefix and generation goes on from
there, so kvtier can only ever make a prompt cheaper, never change its output.

Scope: decoder-only, full-attention models (Llama-like), batch 1, greedy decoding.
Threads: one KVTierHF per model; calls are not meant to overlap (the model is not re-entrant).
Ownership: a KVTierHF that opened its PrefixCache (from a config) closes it in :meth:`close`;
one handed a PrefixCache leaves it open for its owner.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel
from typing_extensions import Self

from kvtier.cache import PrefixCache
from kvtier.chunk import HEADER_SIZE, dtype_itemsize
from kvtier.config import KVTierConfig
from kvtier.keys import HashName, KVLayout, NamespaceSpec
from kvtier.tiers.base import ABSENT
from kvtier.usage.reporter import UsageReporter, release, reporter_for
from kvtier_hf.compat import (
    KV_TO_TORCH_DTYPE,
    TORCH_TO_KV_DTYPE,
    ForwardKwargs,
    has_sliding_layers,
    new_cache,
    seq_length,
    text_config,
)
from kvtier_hf.identity import derived_revision, overrides_suffix
from kvtier_hf.kv import kv_devices, kv_payload
from kvtier_hf.kvpool import KVPool
from kvtier_hf.restore import restore, staging_for

log = logging.getLogger(__name__)

TokenIds = Sequence[int] | np.ndarray | torch.Tensor


def namespace_for(model: PreTrainedModel, chunk_tokens: int = 256, *, model_id: str | None = None,
                  revision: str | None = None, salt: bytes = b"", hash_name: HashName = "sha256",
                  rank: int = 0, world_size: int = 1) -> NamespaceSpec:
    """The namespace of ``model``'s K/V: id from ``model_id`` or ``config.name_or_path``;
    revision from ``revision``, else ``model.kvtier_revision`` (testing builder), else the
    hub commit hash, else a fingerprint of the checkpoint's files or weights (kvtier_hf.identity),
    plus ``+cfg=`` when the config was overridden at load; KV dtype from the parameters; layout
    from the (text) config."""
    cfg = text_config(model.config)
    mid = model_id or getattr(model.config, "name_or_path", "") or ""
    if not mid:
        raise ValueError("model has no config.name_or_path; pass model_id= to name its namespace")
    rev = revision if revision is not None else (
        getattr(model, "kvtier_revision", None) or getattr(model.config, "_commit_hash", None)
        or derived_revision(model))
    rev += overrides_suffix(model.config)
    dtype = next(model.parameters()).dtype
    if dtype not in TORCH_TO_KV_DTYPE:
        raise ValueError(f"model dtype {dtype} has no kvtier KV dtype; expected one of "
                         f"{sorted(str(d) for d in TORCH_TO_KV_DTYPE)}")
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layout = KVLayout(num_layers=cfg.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                      chunk_tokens=chunk_tokens)
    return NamespaceSpec(model_id=mid, layout=layout, kv_dtype=TORCH_TO_KV_DTYPE[dtype],
                         model_revision=rev, rank=rank, world_size=world_size, salt=salt,
                         hash_name=hash_name)


def chunk_nbytes(spec: NamespaceSpec) -> int:
    """Encoded size of one full chunk of ``spec`` (raw codec): what a cpu slot must hold."""
    lay = spec.layout
    return HEADER_SIZE + (lay.num_layers * lay.kv * lay.chunk_tokens * lay.num_kv_heads
                          * lay.head_dim * dtype_itemsize(spec.kv_dtype))


def fit_config(cfg: KVTierConfig, spec: NamespaceSpec) -> KVTierConfig:
    """``cfg`` with ``cpu.slot_bytes`` raised to hold one chunk of ``spec`` if it is smaller
    (a chunk larger than a slot would be refused on every put: a cache that never hits)."""
    need = -(-chunk_nbytes(spec) // 4096) * 4096
    if not cfg.cpu.enabled or cfg.cpu.slot_bytes >= need:
        return cfg
    log.info("cpu.slot_bytes %d < one %s chunk (%d bytes): using %d", cfg.cpu.slot_bytes,
             spec.model_id, need, need)
    cpu = dataclasses.replace(cfg.cpu, slot_bytes=need,
                              capacity_bytes=max(cfg.cpu.capacity_bytes, need))
    return dataclasses.replace(cfg, cpu=cpu)


@dataclass(frozen=True)
class RestoredPrefix:
    """``cache`` holds the K/V of the first ``tokens`` prompt tokens (an empty cache on a miss);
    ``per_tier`` counts the chunks each tier served; ``reason`` says why the hit stopped."""

    cache: Any
    tokens: int
    per_tier: dict[str, int] = field(default_factory=dict)
    reason: str = ABSENT
    seconds: float = 0.0
    nbytes: int = 0  # encoded chunk bytes read from the store


@dataclass(frozen=True, eq=False)
class GenerationResult:
    """Greedy continuation of a prompt and where its time went (seconds, perf_counter)."""

    tokens: tuple[int, ...]
    prompt_tokens: int
    restored_tokens: int
    prefilled_tokens: int
    saved_chunks: int
    hits_per_tier: dict[str, int]
    miss_reason: str
    ttft_s: float
    restore_s: float
    prefill_s: float
    save_s: float
    decode_s: float
    first_logits: torch.Tensor = field(repr=False)
    restore_bytes: int = 0  # encoded chunk bytes the restore read from the store


def _as_ids(input_ids: TokenIds, vocab_size: int | None = None) -> np.ndarray:
    """``input_ids`` as 1-D int64 token ids, each in ``[0, vocab_size)`` when that is known
    (an id outside it would be hashed into keys, then fail deep in the embedding)."""
    ids = _flat_ids(input_ids)
    if vocab_size is not None and len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    return ids


def _flat_ids(input_ids: TokenIds) -> np.ndarray:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(f"kvtier_hf handles batch 1: got input_ids of shape {tuple(input_ids.shape)}")
        return input_ids.detach().cpu().numpy().astype(np.int64)
    ids = np.asarray(input_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"input_ids must be 1-D token ids, got shape {ids.shape}")
    return ids


class KVTierHF:
    """kvtier for one transformers causal LM (see the module docstring).

    ``cache``: a :class:`PrefixCache` is used as given (its namespace names the model; its
    layout and KV dtype must be this model's, else ValueError); a :class:`KVTierConfig` (or
    None: defaults) opens one with the namespace :func:`namespace_for` derives. Raises
    ValueError for models with sliding-window layers.

    Usage reports (kvtier.usage): a KVTierHF that opens its cache from a config with a ``grpc``
    tier sends its counters to those nodes under ``replica_id`` (else ``usage.replica_id``,
    else host-pid); one handed a PrefixCache reports nothing (it has no node list)."""

    def __init__(self, model: PreTrainedModel, cache: PrefixCache | KVTierConfig | None = None, *,
                 chunk_tokens: int | None = None, model_id: str | None = None,
                 revision: str | None = None, replica_id: str = "") -> None:
        self.model = model
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        self._vocab_size: int | None = vocab if isinstance(vocab, int) and vocab > 0 else None
        self.usage: UsageReporter | None = None  # engine usage reports (a config with grpc nodes)
        self._forward = ForwardKwargs.of(model)
        if isinstance(cache, PrefixCache):
            spec = namespace_for(model, chunk_tokens or cache.spec.layout.chunk_tokens,
                                 model_id=model_id or cache.spec.model_id,
                                 revision=revision if revision is not None else cache.spec.model_revision,
                                 salt=cache.spec.salt, hash_name=cache.spec.hash_name,
                                 rank=cache.spec.rank, world_size=cache.spec.world_size)
            if (spec.layout, spec.kv_dtype) != (cache.spec.layout, cache.spec.kv_dtype):
                raise ValueError(
                    f"PrefixCache namespace {cache.spec.layout} / {cache.spec.kv_dtype} does not match "
                    f"this model's {spec.layout} / {spec.kv_dtype}: its chunks cannot be used here")
            self.prefix_cache, self._owns_cache = cache, False
        else:
            cfg = cache if cache is not None else KVTierConfig()
            spec = namespace_for(model, chunk_tokens or cfg.chunk_tokens, model_id=model_id,
                                 revision=revision, salt=cfg.salt,
                                 hash_name=cfg.hash)  # type: ignore[arg-type]
            self.prefix_cache, self._owns_cache = PrefixCache.open(fit_config(cfg, spec), spec), True
            self.usage = reporter_for(cfg, spec.model_id, "hf", replica_id)
        self.spec = self.prefix_cache.spec
        self.dtype = KV_TO_TORCH_DTYPE[self.spec.kv_dtype]
        if has_sliding_layers(new_cache(model.config)):
            raise ValueError("kvtier_hf supports full-attention models; this one has sliding-window layers")
        # The restore's read buffers, allocated and pre-faulted once for this connector's life.
        self._staging = staging_for(self.prefix_cache)
        self._kv_pool = KVPool()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # --- restore / save ------------------------------------------------------------------
    def restore_prefix(self, input_ids: TokenIds) -> RestoredPrefix:
        """Load the longest cached prefix of the prompt, leaving at least its last token to
        prefill (the model must produce logits for it); a partly used chunk is sliced."""
        t0 = time.perf_counter()
        ids = _as_ids(input_ids, self._vocab_size)
        if len(ids) < 2:
            return RestoredPrefix(new_cache(self.model.config), 0, seconds=time.perf_counter() - t0)
        hit = self.prefix_cache.lookup(ids)
        if not hit.tokens:
            self._report_lookup(ids, 0, {}, hit.reason, 0.0, 0)
            return RestoredPrefix(new_cache(self.model.config), 0, {}, hit.reason,
                                  time.perf_counter() - t0)
        use = min(hit.tokens, len(ids) - 1)
        got = restore(self.prefix_cache, ids, hit.tokens, use, self.dtype, self.model.config,
                      # Per layer, looked up now (the model may have moved): a model split over
                      # devices (device_map) attends layer i where its weights are.
                      kv_devices(self.model, self.spec.layout.num_layers),
                      self._staging, self._kv_pool)
        reason = got.reason if got.tokens < use else hit.reason
        log.debug("restored %d/%d prompt tokens (%s)", got.tokens, len(ids), got.per_tier)
        seconds = time.perf_counter() - t0
        if self.usage is not None and got.tokens < use:
            self.usage.counters.record_load_failure()
        self._report_lookup(ids, got.tokens, got.per_tier, reason, seconds, got.nbytes)
        return RestoredPrefix(got.cache, got.tokens, got.per_tier, reason, seconds, got.nbytes)

    def _report_lookup(self, ids: np.ndarray, tokens: int, per_tier: dict[str, int], reason: str,
                       seconds: float, nbytes: int) -> None:
        """Count one prompt for the usage reports: the tokens the engine took from the cache,
        by tier (chunks x chunk_tokens, the partly used last chunk taken off the last tier)."""
        if self.usage is None:
            return
        chunk = self.spec.layout.chunk_tokens
        by_tier = {t: n * chunk for t, n in per_tier.items()}
        if by_tier:
            last = next(reversed(by_tier))
            by_tier[last] -= sum(by_tier.values()) - tokens
        prefix = self.prefix_cache.keys(ids[:chunk])[0].hex() if len(ids) >= chunk else ""
        self.usage.counters.record_lookup(len(ids), by_tier, reason, prefix)
        if tokens:
            self.usage.counters.record_restore(tokens, seconds, nbytes, prefix)

    def restore(self, input_ids: TokenIds) -> tuple[Any, int]:
        """(DynamicCache holding the restored prefix, number of prompt tokens it covers)."""
        r = self.restore_prefix(input_ids)
        return r.cache, r.tokens

    def save(self, input_ids: TokenIds, cache: Any, *, start_token: int = 0) -> int:
        """Store every chunk of the prompt not cached yet, reading K/V from ``cache`` (which
        must hold at least the prompt's tokens). Chunks wholly before ``start_token`` are
        skipped without a lookup. Returns the number of chunks stored."""
        ids = _as_ids(input_ids, self._vocab_size)
        if seq_length(cache) < len(ids):
            raise ValueError(f"cache holds {seq_length(cache)} tokens, the prompt has {len(ids)}")
        layout, dtype = self.spec.layout, self.dtype
        return self.prefix_cache.save(
            ids, lambda s, e: kv_payload(cache, s, e, layout, dtype),
            start_chunk=start_token // layout.chunk_tokens)

    # --- generation ----------------------------------------------------------------------
    def generate(self, input_ids: TokenIds, max_new_tokens: int = 16, *,
                 eos_token_id: int | None = None, use_kvtier: bool = True) -> GenerationResult:
        """Restore, prefill the rest, save the new chunks, then decode greedily.

        ``ttft_s`` runs from the call to the first token's argmax (restore + prefill); saving
        happens after it, as an engine would do off the critical path. ``use_kvtier=False``
        runs the same code without restore or save (the baseline)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        ids = _as_ids(input_ids, self._vocab_size)
        if len(ids) < 1:
            raise ValueError("the prompt needs at least one token")
        t0 = time.perf_counter()
        with torch.inference_mode():
            restored = (self.restore_prefix(ids) if use_kvtier
                        else RestoredPrefix(new_cache(self.model.config), 0))
            t1 = time.perf_counter()
            cache, start = restored.cache, restored.tokens
            rest = torch.as_tensor(ids[start:], device=self.device).unsqueeze(0)
            logits = self.model(**self._forward.build(rest, cache, start)).logits[0, -1].float()
            token = int(torch.argmax(logits))
            t2 = time.perf_counter()
            saved = self.save(ids, cache, start_token=start) if use_kvtier else 0
            t3 = time.perf_counter()
            out = [token]
            pos = len(ids)
            while len(out) < max_new_tokens and token != eos_token_id:
                step = torch.tensor([[token]], device=self.device)
                token = int(torch.argmax(self.model(**self._forward.build(step, cache, pos)).logits[0, -1]))
                out.append(token)
                pos += 1
            t4 = time.perf_counter()
        if self.usage is not None and use_kvtier:
            self.usage.counters.record_prefill_saved(start)
            self.usage.counters.record_ttft(start > 0, t2 - t0)
        return GenerationResult(
            tokens=tuple(out), prompt_tokens=len(ids), restored_tokens=start,
            prefilled_tokens=len(ids) - start, saved_chunks=saved,
            hits_per_tier=dict(restored.per_tier), miss_reason=restored.reason,
            ttft_s=t2 - t0, restore_s=t1 - t0, prefill_s=t2 - t1, save_s=t3 - t2, decode_s=t4 - t3,
            first_logits=logits.cpu(), restore_bytes=restored.nbytes)

    # --- lifecycle -----------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until saved chunks reached every tier (write-behind queue drained)."""
        return self.prefix_cache.store.flush(timeout_s)

    def close(self) -> None:
        release(self.usage)  # the last report goes out
        self.usage = None
        if self._owns_cache:
            self.prefix_cache.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
