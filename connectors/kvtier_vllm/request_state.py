"""What the scheduler half keeps per request: its lookup match, planned load and save progress.

Owned by ``SchedulerSide`` and touched on vLLM's scheduler thread only (no locks). One
``RequestState`` lives from the request's first lookup until ``request_finished``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .partial import is_partial_end
from .protocol import LoadOutcome, LoadSpec

if TYPE_CHECKING:
    from vllm.v1.request import Request


def tokens_bytes(tokens: Iterable[int]) -> bytes:
    return np.fromiter(tokens, dtype="<u4").tobytes()


@dataclass
class LookupMatch:
    start: int          # tokens vLLM already has (block aligned)
    usable: int         # end of the loadable run (block aligned, <= limit)
    tiers: dict[str, int]
    is_async: bool
    at: float
    partial_end: int = 0  # the run's last chunk is the partial chunk ending here (partial.py)
    skipped: int = 0    # hit tokens after ``usable`` left to recompute: loading them is slower


@dataclass
class RequestState:
    request: Request
    salt: bytes
    opaque: bool = False  # token ids do not determine its KV (settings.request_salt): hands off
    saved_upto: int = 0
    seen: bool = False                    # first scheduled yet
    match: LookupMatch | None = None
    load_tiers: dict[str, int] = field(default_factory=dict)  # of the load last planned
    pending: LoadSpec | None = None
    async_inflight: bool = False
    block_ids: list[int] = field(default_factory=list)
    hit_tokens: int = 0
    hit_tiers: dict[str, int] = field(default_factory=dict)
    outcome: LoadOutcome | None = None
    partial_ends: set[int] = field(default_factory=set)  # partial chunks to save (once computed)
    partial_saved: set[int] = field(default_factory=set)
    prompt_end_noted: bool = False        # the prompt's block-aligned end is in partial_ends
    skipped_tokens: int = 0
    _tokens: bytes = b""                  # tokens_bytes of a prefix of the request (see tokens)

    def tokens(self, n: int) -> bytes:
        """The first ``n`` token ids as uint32-LE bytes. A prefix's ids never change, so they
        are encoded once per request (again only when a later call asks past them), not at
        each lookup, load and save."""
        if len(self._tokens) < 4 * n:
            self._tokens = tokens_bytes(self.request.all_token_ids)
        return self._tokens[:4 * n]

    def note_partial_end(self, end: int, chunk: int, block: int) -> None:
        """Remember ``end`` as a prefix end worth a partial chunk once computed, unless it can
        never be one (``partial.is_partial_end``)."""
        if is_partial_end(end, chunk, block):
            self.partial_ends.add(end)
