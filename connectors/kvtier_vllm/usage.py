"""The vLLM connector's engine usage reports (kvtier.usage), fed from the scheduler side.

The scheduler process sees every request from lookup to finish, and the workers' load outcomes
come back to it each step (``KVTierWorkerMeta.loads``), as do their stats
(``KVConnectorOutput.kv_connector_stats``). So one reporter per engine, in the scheduler
process, under the replica id ``usage.replica_id`` or else vLLM's ``engine_id`` (one per engine,
shared by its processes), with source ``vllm``. TTFT is vLLM's own figure and not known here.

Threads: called from the engine core's scheduling loop only; the counters have their own lock.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.usage.reporter import release, reporter_for

from .protocol import LoadOutcome

log = logging.getLogger(__name__)


class SchedulerUsage:
    def __init__(self, cfg: KVTierConfig, model: str, engine_id: str) -> None:
        self.reporter = reporter_for(cfg, model or "unknown", "vllm", cfg.usage.replica_id or engine_id)

    def on_outcome(self, o: LoadOutcome) -> None:
        """A worker finished restoring one request's tokens ``[start, ok_end)``."""
        if self.reporter is None:
            return
        c = self.reporter.counters
        c.record_restore(max(0, o.ok_end - o.start), o.seconds, o.nbytes)
        if o.ok_end < o.end:
            c.record_load_failure()

    def on_worker_stats(self, stats: Any) -> None:
        """The workers' per-step stats: save jobs they dropped (queue full)."""
        data = getattr(stats, "data", None)
        if self.reporter is not None and isinstance(data, dict) and data.get("save_dropped"):
            self.reporter.counters.record_save_drop(int(data["save_dropped"]))

    def on_finished(self, prompt_tokens: int, hit_tokens: int, hit_chunks_by_tier: dict[str, int],
                    chunk_tokens: int, reason: str) -> None:
        """One request done: its prompt, the tokens the cache gave it (by tier: chunks x
        chunk_tokens, the partly used last chunk taken off the last tier), why the rest missed."""
        if self.reporter is None:
            return
        by_tier = {t: n * chunk_tokens for t, n in hit_chunks_by_tier.items() if n > 0}
        excess = sum(by_tier.values()) - max(0, hit_tokens)
        for tier in reversed(list(by_tier)):
            if excess <= 0:
                break
            cut = min(excess, by_tier[tier])
            by_tier[tier] -= cut
            excess -= cut
        c = self.reporter.counters
        c.record_lookup(prompt_tokens, by_tier, reason or "absent")
        c.record_prefill_saved(max(0, hit_tokens))

    def close(self) -> None:
        release(self.reporter)
        self.reporter = None
