"""The SGLang backend's engine usage reports (kvtier.usage), fed by the HiCache controller calls.

What the backend sees is HiCache's L3 traffic, not whole prompts: SGLang asks storage
(``batch_exists``) only for the pages past what its GPU (L1) and host (L2) caches already hold.
So the figures count L3 pages in tokens (pages x page size): *prompt tokens* = tokens SGLang
looked up in kvtier, *hit tokens* = leading tokens kvtier held (by tier), *restored* = tokens
``batch_get_v1`` copied into the host pool (which SGLang then does not prefill), load failures =
gets that fell short of what they asked for, save drops = pages ``batch_set_v1`` could not store.

One reporter per process, model and store nodes, shared by the TP ranks' backends (source
``sglang``; replica ``usage.replica_id`` or the host and process id). Only a store with fixed
``grpc`` nodes reports (there is nowhere else to send). Threads: the controller's prefetch and
backup threads call in; the counters have their own lock.
"""

from __future__ import annotations

from kvtier.config import KVTierConfig
from kvtier.store import LookupResult
from kvtier.usage.reporter import release, reporter_for


class BackendUsage:
    def __init__(self, cfg: KVTierConfig, model: str, page_tokens: int) -> None:
        self.reporter = reporter_for(cfg, model or "unknown", "sglang")
        self.page = page_tokens

    def on_exists(self, pages: int, hit: LookupResult, first_key: bytes) -> None:
        if self.reporter is None:
            return
        by_tier = {tier: n * self.page for tier, n in hit.per_tier.items()}
        self.reporter.counters.record_lookup(pages * self.page, by_tier, hit.reason, first_key.hex())

    def on_get(self, asked: int, restored: int, seconds: float, nbytes: int, first_key: bytes) -> None:
        if self.reporter is None:
            return
        c = self.reporter.counters
        if restored:
            c.record_restore(restored * self.page, seconds, nbytes, first_key.hex())
            c.record_prefill_saved(restored * self.page)
        if restored < asked:
            c.record_load_failure()

    def on_set_failed(self, pages: int) -> None:
        if self.reporter is not None and pages > 0:
            self.reporter.counters.record_save_drop(pages)

    def close(self) -> None:
        release(self.reporter)
        self.reporter = None
