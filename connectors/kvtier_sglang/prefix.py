"""Where a page sits in its prefix: the store keys a kvtier-server cluster places pages by.

Why: the grpc tier places chunk ``d`` of a prefix by the key of chunk ``d - d % group_chunks``
of that prefix (docs/placement.md), given the whole prefix's keys (``prefix=`` on the store's
verbs); without them it places each key by itself. The vLLM and transformers connectors always
pass their prefix, so on a cluster of several nodes an SGLang backend that did not asked the
wrong node for most pages another engine stored, and stored its own where the others do not
look (found by an audit: 1 of 16 pages found either way).

SGLang names a call's prefix only when its extra config has ``hicache_storage_pass_prefix_keys``
on: ``HiCacheStorageExtraInfo.prefix_keys`` is then the page hashes from the sequence start to
the call's first key (``prefix_keys + keys`` is one chain). Its hybrid controller (every model
in a 0.5.23 server) turns an empty prefix into ``None`` for the hit query, so with the flag on
``None`` means depth 0. With the flag off nothing tells a call's depth: pages are placed by
themselves, consistently among SGLang instances but not with the other engines (warned at
attach where that differs: a grpc tier of several nodes with ``group_chunks`` > 1).

Threads: a ``PrefixKeys`` is shared by SGLang's threads; its only mutation is one flag that
goes from off to on (a bool store). A ``PagePrefix`` belongs to one call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, overload

from kvtier.config import KVTierConfig
from kvtier.keys import xengine_key

from .namespace import page_hash_bytes
from .served import PASS_PREFIX_KEYS, pass_prefix_keys

log = logging.getLogger(__name__)


class PagePrefix(Sequence[bytes]):
    """The store keys of a call's whole prefix, chunk 0 first: ``head`` (SGLang's hex page
    hashes before the call) then ``tail`` (the call's store keys). A head key is computed on
    first use: a placement reads one key per group, and hashing a long context's every key on
    every batch would cost O(context) per call. ``index`` finds a tail key without hashing the
    head (a page chain never repeats a key: each hash covers every token before it)."""

    def __init__(self, namespace: bytes, head: Sequence[str], tail: list[bytes]) -> None:
        # A copy of SGLang's list: a write-behind queue may keep this prefix after the call.
        self._namespace, self._head, self._tail = namespace, tuple(head), tail
        self._computed: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._head) + len(self._tail)

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...
    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        depth = index + len(self) if index < 0 else index
        if not 0 <= depth < len(self):
            raise IndexError(f"prefix depth {index} out of range ({len(self)} pages)")
        if depth >= len(self._head):
            return self._tail[depth - len(self._head)]
        key = self._computed.get(depth)
        if key is None:
            key = self._computed[depth] = xengine_key(self._namespace, page_hash_bytes(self._head[depth]))
        return key

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        if value in self._tail:
            depth = len(self._head) + self._tail.index(value)
            if start <= depth and (stop is None or depth < stop):
                return depth
        return super().index(value, start, len(self) if stop is None else stop)


def grouped_cluster(cfg: KVTierConfig) -> bool:
    """Whether the grpc tier may place a page by its group (several nodes, or nodes found by
    discovery, and ``group_chunks`` > 1): only then does the prefix change where a page lives."""
    grpc = cfg.grpc
    return grpc.enabled and grpc.group_chunks > 1 and (len(grpc.nodes) > 1 or bool(grpc.discovery))


class PrefixKeys:
    """Turns a call's ``HiCacheStorageExtraInfo`` into the prefix the store places by."""

    def __init__(self, storage_config: Any, cfg: KVTierConfig) -> None:
        self.passed = pass_prefix_keys(storage_config)  # None: the server does not say
        if grouped_cluster(cfg) and self.passed is not True:
            why = "is off" if self.passed is False else "could not be read from the server's config"
            log.warning(
                "kvtier_sglang: %s %s: this grpc tier (%s, grpc.group_chunks %d) places each page "
                "by its prefix's group, and without the prefix SGLang's pages land where the vLLM "
                "and transformers connectors do not look (and theirs where SGLang does not). Set "
                "\"%s\": true in --hicache-storage-backend-extra-config to share pages with other "
                "engines", PASS_PREFIX_KEYS, why,
                f"discovery {cfg.grpc.discovery}" if cfg.grpc.discovery else f"{len(cfg.grpc.nodes)} nodes",
                cfg.grpc.group_chunks, PASS_PREFIX_KEYS)

    def of(self, namespace: bytes, extra_info: Any, keys: list[bytes]) -> PagePrefix | None:
        """The whole prefix of a call whose store keys are ``keys``, or None where SGLang does
        not say where the call starts (the pages are then placed by themselves). No
        ``extra_info`` at all (the legacy calls, a caller other than SGLang's controller) says
        nothing, flag or not."""
        if extra_info is None:
            return None
        head = extra_info.prefix_keys
        if head is None:
            if not self.passed:
                return None
            head = []  # the flag is on: SGLang passes an empty prefix as None (module docstring)
        else:
            self.passed = True  # SGLang passes a list only with the flag on
        return PagePrefix(namespace, head, keys)
