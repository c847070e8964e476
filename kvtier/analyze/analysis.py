"""Run every analysis over a log and return the report document (the ``--json`` output).

The document's keys are stable and documented in docs/analyze.md; ``schema`` names its version.
Token counts are prompt tokens; ratios are hit tokens / prompt tokens; ``*_per_day`` figures
scale the log's totals by its own rate (null where the log has no timestamps).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.analyze import breakers, replay
from kvtier.analyze.classify import Decode, classify
from kvtier.analyze.cost import Price
from kvtier.analyze.records import Log, Request
from kvtier.policies import DEFAULT_POLICY

SCHEMA = "kvtier.analyze/v1"
DEFAULT_TTLS = (60.0, 300.0, 900.0, 3600.0)


@dataclass(frozen=True)
class Options:
    capacities: tuple[int, ...] = ()  # chunks; empty = default_capacities of the log
    policies: tuple[str, ...] = ()  # empty = every registered policy and belady
    ttls: tuple[float, ...] = DEFAULT_TTLS
    price: Price | None = None
    kv_bytes_per_token: int | None = None
    breaker_sample: int = 3000
    top: int = 10
    decode: Decode | None = field(default=None, compare=False)
    progress: bool = False
    jobs: int = 1  # processes for the replays (see replay.curve)


def _ratio(a: float, b: float) -> float:
    return round(a / b, 6) if b else 0.0


def _per_day(tokens: float, duration: float | None) -> float | None:
    return round(tokens * 86400.0 / duration, 2) if duration else None


def _money(x: float) -> float:
    return round(x, 6)


def _preview(r: Request, tokens: int, decode: Decode | None) -> str:
    if r.head is None or decode is None:
        return f"{tokens} tokens ({(tokens + r.chunk_tokens - 1) // r.chunk_tokens} blocks) from request {r.index}"
    text = decode(r.head[:tokens])
    short = text if len(text) <= 160 else text[:100] + " … " + text[-50:]
    return short + ("" if tokens <= len(r.head) else " …")


def _top_prefixes(reqs: Sequence[Request], bound: np.ndarray, top: int,
                  decode: Decode | None) -> list[dict[str, Any]]:
    # deepest hit key -> [saved, requests, prefix tokens, example's position in ``reqs``] (the
    # position, not Request.index: that is the file's order, and reqs is in replay order)
    agg: dict[bytes, list[int]] = {}
    for j, (r, h) in enumerate(zip(reqs, bound.tolist())):
        if h:
            k = replay.hit_chunks(r, h)
            a = agg.setdefault(r.keys[k - 1], [0, 0, h, j])
            a[0] += h
            a[1] += 1
            if reqs[a[3]].head is None and r.head is not None:
                a[3] = j  # an example whose tokens were kept, for the preview
    best = sorted(agg.values(), key=lambda a: (-a[0], a[3]))[:top]
    return [{"prefix_tokens": t, "requests": n, "saved_tokens": s,
             "preview": _preview(reqs[j], t, decode)} for s, n, t, j in best]


def _groups(reqs: Sequence[Request], attr: str, bound: np.ndarray,
            default_points: list[replay.CurvePoint], chunk_tokens: int) -> list[dict[str, Any]]:
    labels = np.array([getattr(r, attr) for r in reqs], dtype=object)
    tokens = np.array([r.tokens for r in reqs], dtype=np.int64)
    out = []
    for name in sorted(set(labels.tolist())):
        m = labels == name
        total = int(tokens[m].sum())
        out.append({"name": name, "requests": int(m.sum()), "prompt_tokens": total,
                    "bound_hit_ratio": _ratio(int(bound[m].sum()), total),
                    "hit_ratio": [{"capacity_tokens": p.capacity_chunks * chunk_tokens,
                                   "hit_ratio": _ratio(int(p.hits[m].sum()), total)}
                                  for p in default_points]})
    return out


def _breakers(log: Log, opts: Options, duration: float | None) -> dict[str, Any]:
    if not log.has_tokens:
        return {"sampled_requests": 0, "found": [],
                "note": "this log has block hashes, not tokens: breakers need token ids or text"}
    groups, sampled = breakers.detect(log.requests, limit=opts.breaker_sample)
    # every request of a token or text log has tokens; only the sampled ones kept them
    scale = len(log.requests) / sampled if sampled else 0.0
    heads = {r.index: r.head for r in log.requests if r.head is not None}
    found = []
    for g in groups:
        e = g.example
        c = classify(heads[e.a], heads[e.b], e.start, e.end_a, e.end_b, opts.decode)
        lost = g.lost_tokens_sample * scale
        found.append({"kind": c.kind, "detail": c.detail, "fix": c.fix, "start_token": e.start,
                      "span_tokens": [e.end_a - e.start, e.end_b - e.start],
                      "requests": g.requests, "variants": g.variants,
                      "lost_tokens": int(round(lost)), "lost_tokens_per_day": _per_day(lost, duration),
                      "example": {"request_a": e.a, "request_b": e.b, "before": c.before,
                                  "span_a": c.span_a, "span_b": c.span_b, "after": c.after}})
    return {"sampled_requests": sampled, "found": found}


def analyze(log: Log, opts: Options = Options()) -> dict[str, Any]:
    """The report document for ``log``; see docs/analyze.md for every key."""
    t0 = time.perf_counter()
    reqs = log.requests
    total = log.prompt_tokens
    duration = log.duration_s
    C = log.chunk_tokens
    distinct = len({k for r in reqs for k in r.keys})
    caps = sorted(set(opts.capacities)) or replay.default_capacities(distinct)
    names = list(opts.policies) or replay.policy_names()
    bound = replay.unbounded(reqs)
    points = replay.curve(reqs, caps, names, progress=opts.progress, jobs=opts.jobs)
    price = opts.price
    curve = []
    for p in points:
        hit = p.hit_tokens
        entry: dict[str, Any] = {
            "policy": p.policy, "capacity_chunks": p.capacity_chunks, "capacity_tokens": p.capacity_chunks * C,
            "capacity_bytes": p.capacity_chunks * C * opts.kv_bytes_per_token if opts.kv_bytes_per_token else None,
            "hit_tokens": hit, "hit_ratio": _ratio(hit, total), "saved_tokens_per_day": _per_day(hit, duration),
            "money_saved": _money(price.saved(total, hit)) if price else None,
            "money_saved_per_day": _money(price.saved(total, hit) * 86400 / duration) if price and duration else None}
        curve.append(entry)
    has_time = any(r.timestamp is not None for r in reqs)
    ttl = [{"ttl_s": t, "hit_tokens": int(h.sum()), "hit_ratio": _ratio(int(h.sum()), total)}
           for t in opts.ttls for h in [replay.with_ttl(reqs, t)]] if has_time else []
    # the policy groups and savings are shown for: kvtier's default, else the first online one given
    first = DEFAULT_POLICY if DEFAULT_POLICY in names else next((n for n in names if n != replay.BELADY), names[0])
    default_points = [p for p in points if p.policy == first]
    bound_hits = int(bound.sum())
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "log": {"path": log.path, "format": log.source, "requests": len(reqs), "prompt_tokens": total,
                "chunk_tokens": C, "distinct_chunks": distinct, "out_of_order": log.out_of_order,
                "duration_s": duration,
                "requests_per_day": _per_day(len(reqs), duration),
                "output_tokens": sum(r.output_tokens for r in reqs if r.output_tokens is not None)
                if any(r.output_tokens is not None for r in reqs) else None,
                "tenants": len({r.tenant for r in reqs}), "models": len({r.model for r in reqs})},
        "bound": {"hit_tokens": bound_hits, "hit_ratio": _ratio(bound_hits, total),
                  "saved_tokens_per_day": _per_day(bound_hits, duration),
                  "distinct_tokens": distinct * C},
        "default_policy": first,
        "policies": names,
        "curve": curve,
        "ttl": ttl,
        "by_tenant": _groups(reqs, "tenant", bound, default_points, C),
        "by_model": _groups(reqs, "model", bound, default_points, C),
        "top_prefixes": _top_prefixes(reqs, bound, opts.top, opts.decode),
        "breakers": _breakers(log, opts, duration),
        "cost": None if price is None else {
            "model": price.model, "currency": price.currency, "input_per_mtok": price.input_per_mtok,
            "cache_read_multiplier": price.cache_read_multiplier,
            "cache_write_multiplier": price.cache_write_multiplier,
            "without_cache": _money(price.input_per_mtok * total / 1e6),
            "without_cache_per_day": _money(price.input_per_mtok * total / 1e6 * 86400 / duration) if duration else None,
            "bound_saved": _money(price.saved(total, bound_hits))},
    }
    doc["seconds"] = round(time.perf_counter() - t0, 3)
    return doc
