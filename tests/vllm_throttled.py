"""``KVTierConnector`` over one ``FaultyTier`` whose reads are throttled (tests only).

vLLM loads it by configuration (``kv_connector_module_path="tests.vllm_throttled"``) in the
scheduler and worker processes alike; the worker's store becomes a single FaultyTier named
``faulty``. Its read bandwidth is read from the file named by ``FAULTY_TIER_CONTROL`` (bytes per
second as text; 0 or a missing file: unthrottled) whenever that file changes, so a test can
slow the tier down and speed it up while the engine runs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from kvtier_vllm import KVTierConnector as _KVTierConnector

from kvtier.store import TieredStore
from kvtier.tiers.base import Miss
from tests.fakes import FaultyTier

CONTROL_ENV = "FAULTY_TIER_CONTROL"


class ControlledTier(FaultyTier):
    def __init__(self, control: str) -> None:
        super().__init__(512 << 20, name="faulty")
        self.control = control
        self._stamp: float | None = None

    def _refresh(self) -> None:
        try:
            stamp = os.stat(self.control).st_mtime_ns
        except FileNotFoundError:
            self.read_bytes_per_s = 0.0
            return
        if stamp != self._stamp:
            self._stamp = stamp
            with open(self.control) as f:
                self.read_bytes_per_s = float(f.read().strip() or 0)

    def get(self, keys: Sequence[bytes]) -> list[bytes | Miss]:
        self._refresh()
        return super().get(keys)


class KVTierConnector(_KVTierConnector):
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        worker = self._worker
        assert worker is not None
        old = worker.store
        # Before the first lookup binds a cache to the store (as test_vllm_connector_flow does).
        worker.store = TieredStore([ControlledTier(os.environ[CONTROL_ENV])], metrics=worker.metrics)
        old.close()
