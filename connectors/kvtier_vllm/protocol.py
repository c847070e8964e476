"""Messages between the scheduler half and the worker half (pickled by vLLM each step).

Token ids travel as uint32-LE ``bytes`` (compact to pickle, and exactly what kvtier keys hash).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from .events import EventBatch

# Steps back a failed step can still be undone (the scheduler's replan, the workers' purge);
# the failure's report comes back one or two steps later.
STEPS_REMEMBERED = 8


@dataclass
class LoadSpec:
    """Restore tokens ``[start, end)`` (whole engine blocks) into ``block_ids`` (one per block).

    ``tokens`` covers the full chunks that hold them (``ceil(end / C) * C`` tokens), or, with
    ``partial_end``, ``partial_end`` tokens whose last chunk ``[partial_end // C * C,
    partial_end)`` is a partial chunk (partial.py) that holds the tail of the range."""

    req_id: str
    salt: bytes
    tokens: bytes
    start: int
    end: int
    block_ids: list[int]
    is_async: bool
    partial_end: int = 0


@dataclass
class SaveSpec:
    """Save full chunks ``[start_chunk, end_chunk)``; ``block_ids`` hold their tokens in order
    and ``tokens`` is the prefix up to ``end_chunk * C``. ``partial``: one partial chunk instead
    (``end_chunk == start_chunk + 1``, ``tokens`` ends inside it, ``block_ids`` are its blocks)."""

    req_id: str
    salt: bytes
    tokens: bytes
    start_chunk: int
    end_chunk: int
    block_ids: list[int]
    partial: bool = False


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Requests whose prefetch will never be used (finished, or the scheduler took no hit).
    dropped: list[str] = field(default_factory=list)
    step_tokens: int = 0       # tokens this step computes (the worker times its prefill rate)
    skipped_tokens: int = 0    # hit tokens the scheduler left to recompute for speed
    step: int = 0              # this step's number, echoed in KVTierWorkerMeta.failed_steps
    # Steps some rank reported failed: every rank deletes what it saved in them (a rank whose
    # own load succeeded still computed over the failed rank's blocks, through the all-reduce).
    purge_steps: list[int] = field(default_factory=list)


@dataclass
class LoadOutcome:
    """What a worker restored for one request: tokens ``[start, ok_end)`` are good."""

    start: int
    end: int
    ok_end: int
    per_tier: dict[str, int] = field(default_factory=dict)
    reason: str = ""
    seconds: float = 0.0
    nbytes: int = 0

    @classmethod
    def none_of(cls, spec: LoadSpec, reason: str) -> LoadOutcome:
        """Nothing of ``spec`` restored (every block of it fails), because of ``reason``."""
        return cls(spec.start, spec.end, spec.start, {}, reason)


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler feedback of one step (aggregated over TP ranks by vLLM)."""

    loads: dict[str, LoadOutcome] = field(default_factory=dict)
    events: EventBatch | None = None  # KV events (events.py); only rank 0 reports them
    # Steps whose sync load fell short: every save of such a step was dropped, since vLLM's
    # prefix cache may have let any request of the step compute over the unrestored blocks.
    failed_steps: list[int] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVTierWorkerMeta):
            return self
        out = KVTierWorkerMeta(dict(self.loads), self.events or other.events,
                               sorted(set(self.failed_steps) | set(other.failed_steps)))
        for req_id, o in other.loads.items():
            mine = out.loads.get(req_id)
            # A prefix is only as good as its worst shard.
            if mine is None or o.ok_end < mine.ok_end:
                out.loads[req_id] = o
        return out
