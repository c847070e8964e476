"""KVTierStorage over kvtier's fault-injecting tier, loadable by SGLang's dynamic factory.

``module_path: "faulty_backend"``, ``class_name: "FaultyKVTierStorage"``; the extra config's
``faults`` section holds FaultyTier's probabilities (seeded, so a run repeats). The last
instance built is kept in ``LAST`` so a check can read the tier's injection counters.
"""

from __future__ import annotations

from typing import Any

from fakes import FaultyTier
from kvtier_sglang import KVTierStorage

from kvtier.store import TieredStore

LAST: list[FaultyKVTierStorage] = []


class FaultyKVTierStorage(KVTierStorage):
    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        faults = extra.pop("faults", {})
        storage_config.extra_config = extra
        self.tier = FaultyTier(capacity_bytes=1 << 26, **faults)
        self.own_store = TieredStore([self.tier])
        super().__init__(storage_config, kwargs, store=self.own_store)
        LAST.append(self)

    def close(self) -> None:
        super().close()
        self.own_store.close()
