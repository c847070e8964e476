"""One request of a log, as every analysis module sees it (whatever format it was read from).

A request is reduced to the chained chunk keys a prefix cache would look up (kvtier's own key
chain for token logs, the trace's block ids for Mooncake traces), how many prompt tokens each
key covers, and the metadata the reports group by. The first tokens of the prompt are kept
(``head``) so that breakers can be found and shown; the rest are not, so a long log fits in RAM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Request:
    """One prompt. ``index`` is its position in the file (0-based, blank lines not counted),
    whatever its place in the replay order. ``keys[i]`` covers ``chunk_tokens`` tokens except the last, which covers
    the rest of ``tokens`` (a trailing partial chunk is keyed over its actual tokens).

    ``head`` holds the first tokens (uint32, at most the reader's window) or is None where the
    log has no tokens (block-hash traces). ``timestamp`` is in seconds, None when absent.
    """

    index: int
    keys: tuple[bytes, ...]
    tokens: int
    chunk_tokens: int
    timestamp: float | None = None
    tenant: str = ""
    model: str = ""
    output_tokens: int | None = None
    head: np.ndarray | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Log:
    """A whole log in replay order (see :func:`time_order`). ``source`` names the format it was
    read as; ``out_of_order`` counts the requests the file had out of timestamp order."""

    path: str
    source: str  # "tokens" | "text" | "mooncake"
    requests: tuple[Request, ...]
    chunk_tokens: int
    out_of_order: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def duration_s(self) -> float | None:
        """Seconds from the first to the last timestamp, None without (or with one) timestamp."""
        ts = [r.timestamp for r in self.requests if r.timestamp is not None]
        if len(ts) < 2 or max(ts) <= min(ts):
            return None
        return max(ts) - min(ts)

    @property
    def has_tokens(self) -> bool:
        return any(r.head is not None for r in self.requests)


def time_order(requests: list[Request]) -> tuple[list[Request], int]:
    """``requests`` (in file order) in replay order, and how many were out of order.

    The replay order is timestamp order, by a stable sort: ties keep their file order, and a
    request without a timestamp keeps its place after the request before it in the file (those
    before any timestamp come first). Out of order = earlier than some request before it in the
    file (two replicas' logs concatenated, a reversed log). A log already in order (the usual
    case) is returned as is after one pass, so a large log costs no copy; otherwise the sort
    holds one float and one index per request besides the new list of the same objects.
    """
    times: list[float] = []
    now = high = -math.inf
    late = 0
    for r in requests:
        if r.timestamp is not None:
            now = r.timestamp
        times.append(now)
        if now < high:
            late += 1
        else:
            high = now
    if not late:
        return requests, 0
    return [requests[i] for i in sorted(range(len(requests)), key=times.__getitem__)], late
