"""SGLang's legacy per-page tensor API (a dynamic backend without ``"interface_v1": 1``).

SGLang then calls ``batch_exists`` as in v1, ``batch_get(keys, flat_pages)`` with pages from its
``get_dummy_flat_data_page`` and ``batch_set(keys, pages)`` with its ``get_data_page`` copies: flat
pages in the host layout, which pass through the same canonical page views as the v1 path, so
pages written either way read back either way. No prefix keys come with these calls: a grpc
cluster places these pages by themselves (prefix.py). Same failure contract as v1: a failure is
``None`` / ``False`` and a log line, never an exception into SGLang's threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvtier.cache import PrefixCache

from .namespace import store_keys
from .pages import PageGeometry, load_page, page_view
from .settings import SglangSettings
from .stats import BackendStats


class LegacyTensorAPI:
    """Mixin of KVTierStorage (storage.py), which provides what is declared here."""

    settings: SglangSettings
    namespace: bytes
    stats: BackendStats
    _writer: bool

    if TYPE_CHECKING:
        def batch_exists(self, keys: list[str], extra_info: Any = None) -> int: ...
        def _ready(self) -> tuple[PrefixCache, PageGeometry, torch.Tensor]: ...
        def _fail(self, verb: str, n: int, exc: BaseException) -> None: ...
        def _store_pages(self, cache: PrefixCache, geo: PageGeometry, views: list[torch.Tensor],
                         xkeys: list[bytes], first: int, depth0: int, parent0: bytes,
                         prefix: Sequence[bytes] | None) -> int: ...

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """One page into ``target_location`` (a flat page in the host layout, as SGLang's
        ``get_dummy_flat_data_page`` makes it) or a new tensor; None on a miss."""
        if not self.settings.load:
            return None
        try:
            cache, geo, _ = self._ready()
            target = target_location if target_location is not None else torch.empty(
                int(np.prod(geo.buffer_dims(geo.page_tokens))), dtype=geo.dtype)
            run = cache.load_verified(store_keys(self.namespace, [key]), [(0, geo.page_tokens)])
            if not run.payloads:
                return None
            load_page(page_view(geo, target.view(geo.buffer_dims(geo.page_tokens)), 0), run.payloads[0])
        except Exception as exc:  # never into SGLang's threads: see storage._EXPECTED
            self._fail("get", 1, exc)
            return None
        self.stats.add("pages_read")
        result: torch.Tensor = target
        return result

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat host-layout pages (SGLang's ``get_data_page``) under ``keys``."""
        if not keys:
            return True
        if not self.settings.save or not self._writer:
            return True
        try:
            cache, geo, _ = self._ready()
            dims = geo.buffer_dims(geo.page_tokens)
            xkeys = store_keys(self.namespace, keys)
            views = [page_view(geo, v.reshape(dims), 0) for v in values]
            accepted = self._store_pages(cache, geo, views, xkeys, 0, 0, b"", None)
        except Exception as exc:  # never into SGLang's threads: see storage._EXPECTED
            self._fail("set", len(keys), exc)
            return False
        self.stats.wrote(accepted, accepted * geo.page_bytes, 0.0)
        return accepted == len(keys)
