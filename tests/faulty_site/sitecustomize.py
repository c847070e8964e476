"""Test-only start-up hook: with ``KVTIER_TEST_FAULTY_TIER`` set (JSON keyword arguments), kvtier's
store in this process is one ``tests.fakes.FaultyTier`` (a real memory tier that injects faults).

tests/vllm_replica.py puts this directory first on the ``PYTHONPATH`` of a replica started with
the ``faulty_tier`` option, and of nothing else: vLLM spawns its engine core and workers on CPU
(``platforms/cpu.py`` forces ``spawn``), so a patch made in the replica process would not reach
the connector; every spawned interpreter runs this file at start instead.
"""

from __future__ import annotations

import json
import os
from typing import Any

_SPEC = os.environ.get("KVTIER_TEST_FAULTY_TIER")

if _SPEC:
    import kvtier.tiers.factory as _factory

    def _build_faulty(cfg: Any) -> list[Any]:
        from tests.fakes import FaultyTier

        return [FaultyTier(64 << 20, name="cpu", **json.loads(_SPEC or "{}"))]

    _factory.build_tiers = _build_faulty
