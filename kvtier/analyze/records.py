"""One request of a log, as every analysis module sees it (whatever format it was read from).

A request is reduced to the chained chunk keys a prefix cache would look up (kvtier's own key
chain for token logs, the trace's block ids for Mooncake traces), how many prompt tokens each
key covers, and the metadata the reports group by. The first tokens of the prompt are kept
(``head``) so that breakers can be found and shown; the rest are not, so a long log fits in RAM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Request:
    """One prompt. ``keys[i]`` covers ``chunk_tokens`` tokens except the last, which covers
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
    """A whole log in file order. ``source`` names the format it was read as."""

    path: str
    source: str  # "tokens" | "text" | "mooncake"
    requests: tuple[Request, ...]
    chunk_tokens: int

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
