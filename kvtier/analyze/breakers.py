"""Find cache breakers: requests that share a long prefix except a short divergent span.

The signature: two prompts agree up to token ``l``, disagree over a short span (a timestamp,
a reordered tool list, a user's name), then agree again for a long run. A prefix cache serves
neither of them past ``l``: the long run after the span is lost reuse. Detection, on a sample
of the log (the first ``head`` tokens of each prompt, see :mod:`kvtier.analyze.readers`):

1. Sort the sampled prompts: neighbours in sorted order share the longest prefixes, and each
   neighbour pair whose common prefix ends at ``l`` is a boundary between two variants.
2. Anchor both prompts of a pair with content-defined 8-token windows (a rolling hash, kept
   where it is 0 mod 8) within ``max_span`` tokens after ``l``; the first anchor both have is a
   re-convergence candidate. Extending the match backwards gives the end of the divergent span,
   forwards the shared run after it; a pair counts when the run is at least ``min_shared`` tokens
   and at least as long as the span. Each variant after the first loses that run once.
3. Pairs are grouped into breakers (union of pairs sharing the tokens before the divergence or
   after the re-convergence), each classified by :mod:`kvtier.analyze.classify` and costed as
   the shared tokens after the span, scaled from the sample to the log and to a day.

Pure computation on numpy arrays; deterministic; never raises on odd prompts (empty ones are
skipped). Cost is a lower bound where the shared run extends past the kept head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.analyze.records import Request

ANCHOR_TOKENS = 8
ANCHOR_EVERY = 8
CONTEXT_TOKENS = 8
#: Re-convergence candidates tried per prompt (bounds the work on long divergent text).
MAX_TRIES = 48
_MULT = np.uint64(0x100000001B3)


@dataclass(frozen=True)
class BreakerPair:
    """Prompts ``a`` and ``b`` (request indexes) agree on ``[0, start)``, diverge over
    ``[start, end_a)`` / ``[start, end_b)``, then agree for ``shared_after`` tokens."""

    a: int
    b: int
    start: int
    end_a: int
    end_b: int
    shared_after: int


@dataclass(frozen=True)
class BreakerGroup:
    pairs: tuple[BreakerPair, ...]
    requests: int  # distinct sampled requests involved
    variants: int  # distinct divergent spans
    lost_tokens_sample: int  # shared tokens after the span, summed over pairs

    @property
    def example(self) -> BreakerPair:
        """The pair with the longest run after the span (the clearest one to show)."""
        return max(self.pairs, key=lambda p: (p.shared_after, -p.a, -p.b))


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    if m == 0:
        return 0
    ne = np.flatnonzero(a[:m] != b[:m])
    return int(ne[0]) if ne.size else m


def _anchors(t: np.ndarray) -> dict[int, int]:
    """Content-defined anchors of ``t``: window hash -> first position."""
    n = len(t) - ANCHOR_TOKENS + 1
    if n <= 0:
        return {}
    h = np.zeros(n, dtype=np.uint64)
    x = t.astype(np.uint64)
    for j in range(ANCHOR_TOKENS):
        h = h * _MULT + x[j: j + n] + np.uint64(1)
    h ^= h >> np.uint64(29)
    pos = np.flatnonzero((h * _MULT >> np.uint64(40)) % np.uint64(ANCHOR_EVERY) == 0)
    out: dict[int, int] = {}
    for p, v in zip(pos.tolist(), h[pos].tolist()):
        out.setdefault(v, p)
    return out


def sample(requests: Sequence[Request], limit: int) -> list[Request]:
    """Up to ``limit`` requests with tokens, evenly spread over the log."""
    have = [r for r in requests if r.head is not None and len(r.head) > 0]
    if len(have) <= limit:
        return have
    step = len(have) / limit
    return [have[int(i * step)] for i in range(limit)]


def _window_anchors(t: np.ndarray, lo: int, hi: int) -> dict[int, int]:
    """Anchors of ``t`` starting in ``[lo, hi]``: window hash -> first position."""
    return {v: p + lo for v, p in _anchors(t[lo: hi + ANCHOR_TOKENS]).items()}


def find_pairs(reqs: Sequence[Request], max_span: int, min_shared: int) -> list[BreakerPair]:
    """Neighbours in sorted order that diverge and re-converge: one pair per variant boundary."""
    hs: list[np.ndarray] = [r.head for r in reqs if r.head is not None]
    if len(hs) != len(reqs):
        raise ValueError("find_pairs needs requests with tokens")
    order = sorted(range(len(hs)), key=lambda i: hs[i].tobytes())
    pairs: list[BreakerPair] = []
    for x, y in zip(order, order[1:]):
        ta, tb = hs[x], hs[y]
        c = _lcp(ta, tb)
        if c >= min(len(ta), len(tb)) - ANCHOR_TOKENS:
            continue  # one extends the other: an ordinary prefix hit
        an_b = _window_anchors(tb, c, c + max_span)
        tried = 0
        for v, pa in sorted(_window_anchors(ta, c, c + max_span).items(), key=lambda kv: kv[1]):
            pb = an_b.get(v)
            if pb is None:
                continue
            tried += 1
            if tried > MAX_TRIES:
                break
            found = _pair(ta, tb, pa, pb, max_span, min_shared)
            if found is None:
                continue  # e.g. a moved block that matches but is followed by other text
            s, ea, eb, run = found
            a, b = reqs[x].index, reqs[y].index
            pairs.append(BreakerPair(a, b, s, ea, eb, run) if a < b else BreakerPair(b, a, s, eb, ea, run))
            break  # the first re-convergence is the breaker; later anchors only repeat it
    return pairs


def _pair(ta: np.ndarray, tb: np.ndarray, pa: int, pb: int, max_span: int,
          min_shared: int) -> tuple[int, int, int, int] | None:
    start = _lcp(ta, tb)
    if pa < start or pb < start:
        return None
    # walk back from the anchor while both agree: where the divergent span ends
    back = _lcp(ta[start:pa][::-1], tb[start:pb][::-1])
    ea, eb = pa - back, pb - back
    if ea == start and eb == start:
        return None
    if max(ea, eb) - start > max_span:
        return None
    run = _lcp(ta[ea:], tb[eb:])
    if run < min_shared or run < max(ea, eb) - start:
        return None
    return start, ea, eb, run


def group_pairs(pairs: Sequence[BreakerPair], heads: dict[int, np.ndarray]) -> list[BreakerGroup]:
    """Union pairs that share the tokens before their divergence or after re-convergence."""
    parent = list(range(len(pairs)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    seen: dict[tuple[str, bytes], int] = {}
    for n, p in enumerate(pairs):
        ta = heads[p.a]
        before = ta[max(0, p.start - CONTEXT_TOKENS): p.start].tobytes()
        after = ta[p.end_a: p.end_a + CONTEXT_TOKENS].tobytes()
        for key in (("before", before), ("after", after)):
            if key in seen:
                parent[find(n)] = find(seen[key])
            else:
                seen[key] = n
    members: dict[int, list[BreakerPair]] = {}
    for n, p in enumerate(pairs):
        members.setdefault(find(n), []).append(p)
    groups = []
    for ps in members.values():
        reqs = {x for p in ps for x in (p.a, p.b)}
        variants = {heads[p.a][p.start:p.end_a].tobytes() for p in ps} | \
            {heads[p.b][p.start:p.end_b].tobytes() for p in ps}
        groups.append(BreakerGroup(tuple(ps), len(reqs), len(variants),
                                   sum(p.shared_after for p in ps)))
    groups.sort(key=lambda g: -g.lost_tokens_sample)
    return groups


def detect(requests: Sequence[Request], *, limit: int = 3000, max_span: int = 1024,
           min_shared: int = 64) -> tuple[list[BreakerGroup], int]:
    """Breaker groups found in a sample of ``requests``, and the sample's size."""
    reqs = sample(requests, limit)
    heads = {r.index: r.head for r in reqs if r.head is not None}
    return group_pairs(find_pairs(reqs, max_span, min_shared), heads), len(reqs)
