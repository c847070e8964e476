"""The ``engines`` section of /api/cluster: the engines' usage reports merged across nodes.

Every replica reports to every node its store uses, so the same key ``(tenant, model, replica,
source)`` usually appears on several nodes, with the same cumulative figures. Copies are merged,
never added: per counter the largest value (a node that missed reports, or restarted, has less,
never more), the time series of the copy that holds the most tokens, the freshest ``age_s`` (a
replica is stale only when no node heard from it for 3 intervals). Keys are then summed into
replicas (over sources), models, tenants and the cluster. Pure: no I/O; unit-tested directly.

Figures (``summary``): ``prompt_tokens`` looked up, ``hit_tokens`` (by ``tier``) and
``miss_tokens`` (by ``reason``), ``hit_ratio`` = hit / prompt tokens, tokens restored and prefill
tokens saved, load failures, save drops, restore latency (mean and p50/p95 from the histogram,
ms), TTFT of requests that restored a prefix vs not (mean, ms).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvtier.usage.counters import BUCKET_LABELS

TOP = 10
SERIES_MODELS = 5  # models drawn as their own line (the biggest by prompt tokens)


def _key(entry: Mapping[str, Any]) -> tuple[str, str, str, str]:
    return (str(entry["tenant"]), str(entry["model"]), str(entry["replica"]), str(entry["source"]))


def merge_copies(docs: Iterable[tuple[str, Mapping[str, Any]]]) -> tuple[list[dict[str, Any]], float, float]:
    """(one merged entry per key, the bucket size, the newest ``now``) from (node, usage doc)s."""
    copies: dict[tuple[str, str, str, str], list[tuple[str, Mapping[str, Any]]]] = defaultdict(list)
    bucket_s, now = 0.0, 0.0
    for node, doc in docs:
        bucket_s = bucket_s or float(doc.get("bucket_s", 10.0))
        if float(doc.get("bucket_s", bucket_s)) != bucket_s:
            continue  # a node with another bucket size cannot be merged bucket by bucket
        now = max(now, float(doc.get("now", 0.0)))
        for entry in doc.get("replicas", ()):
            copies[_key(entry)].append((node, entry))
    merged = []
    for key, group in copies.items():
        totals: dict[str, float] = {}
        for _, e in group:
            for name, v in e.get("totals", {}).items():
                totals[name] = max(totals.get(name, 0.0), float(v))
        # One copy's series, the most complete: two nodes may file the same report in adjacent
        # buckets (it reached them either side of a boundary), so buckets must not be mixed.
        fullest = max((e for _, e in group), key=lambda e: sum(float(p) for _, p, _ in e.get("series", ())))
        series = {int(b): [float(p), float(h)] for b, p, h in fullest.get("series", ())}
        freshest = min((e for _, e in group), key=lambda e: float(e.get("age_s", 0.0)))
        merged.append({
            "tenant": key[0], "model": key[1], "replica": key[2], "source": key[3],
            "nodes": sorted(n for n, _ in group), "age_s": float(freshest.get("age_s", 0.0)),
            "interval_s": float(freshest.get("interval_s", 0.0)),
            "stale": all(bool(e.get("stale")) for _, e in group),
            "restarts": max(int(e.get("restarts", 0)) for _, e in group),
            "totals": totals, "series": series, "top_prefixes": freshest.get("top_prefixes", [])})
    return merged, bucket_s or 10.0, now


def _labelled(totals: Mapping[str, float], base: str) -> dict[str, float]:
    prefix = base + "/"
    return {k[len(prefix):]: v for k, v in totals.items() if k.startswith(prefix) and v}


def _quantile_ms(totals: Mapping[str, float], q: float) -> float | None:
    count = totals.get("restore_seconds_count", 0.0)
    if not count:
        return None
    for label in BUCKET_LABELS:
        if totals.get(f"restore_seconds_bucket/{label}", 0.0) >= q * count:
            return None if label == "+Inf" else float(label) * 1000
    return None


def _mean_ms(total: float, count: float) -> float | None:
    return round(total / count * 1000, 3) if count else None


def summary(totals: Mapping[str, float]) -> dict[str, Any]:
    hits = _labelled(totals, "hit_tokens")
    prompt = totals.get("prompt_tokens", 0.0)
    ttft_sum, ttft_n = _labelled(totals, "ttft_seconds_sum"), _labelled(totals, "ttft_seconds_count")
    return {
        "lookups": int(totals.get("lookups", 0)), "prompt_tokens": int(prompt),
        "hit_tokens": int(sum(hits.values())), "hit_ratio": sum(hits.values()) / prompt if prompt else None,
        "hits_per_tier": {k: int(v) for k, v in hits.items()},
        "misses_per_reason": {k: int(v) for k, v in _labelled(totals, "miss_tokens").items()},
        "restored_tokens": int(totals.get("restored_tokens", 0)),
        "restored_bytes": int(totals.get("restored_bytes", 0)),
        "prefill_tokens_saved": int(totals.get("prefill_tokens_saved", 0)),
        "load_failures": int(totals.get("load_failures", 0)), "save_drops": int(totals.get("save_drops", 0)),
        "restore_ms_mean": _mean_ms(totals.get("restore_seconds_sum", 0.0), totals.get("restore_seconds_count", 0.0)),
        "restore_ms_p50": _quantile_ms(totals, 0.5), "restore_ms_p95": _quantile_ms(totals, 0.95),
        "ttft_ms_hit": _mean_ms(ttft_sum.get("hit", 0.0), ttft_n.get("hit", 0.0)),
        "ttft_ms_miss": _mean_ms(ttft_sum.get("miss", 0.0), ttft_n.get("miss", 0.0)),
    }


def _sum(entries: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    out: Counter[str] = Counter()
    for e in entries:
        out.update(e["totals"])
    return dict(out)


def _series(entries: Iterable[Mapping[str, Any]], bucket_s: float, first: int, last: int) -> list[list[Any]]:
    """[[bucket start (unix s), prompt tokens, hit tokens, hit ratio or None], ...] for every
    bucket from ``first`` to ``last`` (empty buckets included: a gap in traffic shows as one)."""
    cells: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in entries:
        for b, (p, h) in e["series"].items():
            cells[b][0] += p
            cells[b][1] += h
    out = []
    for b in range(first, last + 1):
        p, h = cells[b] if b in cells else (0.0, 0.0)
        out.append([b * bucket_s, int(p), int(h), h / p if p else None])
    return out


def _group(entries: Sequence[Mapping[str, Any]], fields: tuple[str, ...]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, ...], list[Mapping[str, Any]]] = defaultdict(list)
    for e in entries:
        groups[tuple(str(e[f]) for f in fields)].append(e)
    rows = []
    for key, members in groups.items():
        row: dict[str, Any] = dict(zip(fields, key))
        row.update(summary(_sum(members)))
        row["stale"] = all(m["stale"] for m in members)
        row["age_s"] = min(m["age_s"] for m in members)
        row["nodes"] = sorted({n for m in members for n in m["nodes"]})
        row["restarts"] = sum(m["restarts"] for m in members)
        rows.append(row)
    rows.sort(key=lambda r: (-r["prompt_tokens"], tuple(r[f] for f in fields)))
    return rows


def engines_document(docs: Iterable[tuple[str, Mapping[str, Any]]], buckets: int = 90) -> dict[str, Any]:
    """The ``engines`` section from each up node's (node id, /api/stats ``usage``)."""
    merged, bucket_s, now = merge_copies(docs)
    last = int(now // bucket_s) if now else 0
    used = [b for e in merged for b in e["series"]]
    first = max(min(used, default=last), last - buckets + 1)
    by_model = _group(merged, ("model",))
    prefixes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in merged:
        for p, hits, nbytes in e["top_prefixes"]:
            prefixes[str(p)][0] += int(hits)
            prefixes[str(p)][1] += int(nbytes)
    top: list[dict[str, Any]] = [{"prefix": p, "hit_tokens": h, "restored_bytes": b}
                                 for p, (h, b) in prefixes.items()]
    replicas = _group(merged, ("tenant", "model", "replica"))
    return {
        "bucket_s": bucket_s, "reporting": sum(1 for r in replicas if not r["stale"]),
        "stopped": [{"replica": r["replica"], "model": r["model"], "tenant": r["tenant"], "age_s": r["age_s"]}
                    for r in replicas if r["stale"]],
        "totals": summary(_sum(merged)),
        "series": _series(merged, bucket_s, first, last),
        "series_by_model": {r["model"]: _series([e for e in merged if e["model"] == r["model"]], bucket_s, first, last)
                            for r in by_model[:SERIES_MODELS]},
        "replicas": replicas, "models": by_model, "tenants": _group(merged, ("tenant",)),
        "top_prefixes_by_hits": sorted(top, key=lambda x: (-int(x["hit_tokens"]), str(x["prefix"])))[:TOP],
        "top_prefixes_by_bytes": sorted(top, key=lambda x: (-int(x["restored_bytes"]), str(x["prefix"])))[:TOP],
    }

