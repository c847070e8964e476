"""The terminal summary of an analysis document (:func:`kvtier.analyze.analysis.analyze`)."""

from __future__ import annotations

from typing import Any


def human(n: float | None, unit: str = "") -> str:
    """1234567 -> '1.23M' (None -> 'n/a')."""
    if n is None:
        return "n/a"
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}{unit}"
    return f"{n:.3g}{unit}"


def capacity(p: dict[str, Any]) -> str:
    """A curve entry's capacity: tokens, and bytes where known ('450k (55GiB)')."""
    b = p.get("capacity_bytes")
    return human(p["capacity_tokens"]) + (f" ({b / 2**30:.3g}GiB)" if b else "")


def _short(text: str, n: int = 70, tail: bool = False) -> str:
    """``text`` on one line, cut to ``n`` characters (keeping its end when ``tail``)."""
    text = text.replace("\n", "⏎")
    if len(text) <= n:
        return text
    return "…" + text[1 - n:] if tail else text[: n - 1] + "…"


def summary(doc: dict[str, Any]) -> str:
    """A few screens of plain text: log, bound, curve, TTL, breakers, cost."""
    lg, b = doc["log"], doc["bound"]
    cur = doc["cost"]["currency"] if doc["cost"] else ""
    out = [f"log {lg['path']} ({lg['format']}): {lg['requests']} requests, "
           f"{human(lg['prompt_tokens'])} prompt tokens, {lg['tenants']} tenant(s), {lg['models']} model(s)"
           + (f", {lg['duration_s'] / 3600:.2f} h" if lg["duration_s"] else "")
           + (f"\n  ({lg['out_of_order']} requests were out of timestamp order in the file: "
              "replayed in timestamp order)" if lg.get("out_of_order") else ""),
           f"perfect prefix cache (the bound): {b['hit_ratio']:.1%} of prompt tokens "
           f"({human(b['hit_tokens'])} tokens; {human(b['saved_tokens_per_day'])}/day), "
           f"needs {human(b['distinct_tokens'])} tokens of KV",
           "", "hit ratio by cache capacity (tokens of KV), * = the default policy (kvtier's, or the first one given):"]
    names = doc["policies"]
    caps = sorted({p["capacity_tokens"] for p in doc["curve"]})
    by = {(p["policy"], p["capacity_tokens"]): p for p in doc["curve"]}
    out.append(f"{'capacity':>10} " + " ".join(f"{n + ('*' if n == doc['default_policy'] else ''):>9}" for n in names)
               + (f" {'saved/day':>11}" if doc["cost"] else ""))
    for c in caps:
        row = f"{capacity(by[(names[0], c)]):>10} " + " ".join(f"{by[(n, c)]['hit_ratio']:>9.1%}" for n in names)
        if doc["cost"]:
            m = by[(doc["default_policy"], c)]["money_saved_per_day"]
            m = m if m is not None else by[(doc["default_policy"], c)]["money_saved"]
            row += f" {human(m):>7} {cur}"
        out.append(row)
    if doc["ttl"]:
        out += ["", "unbounded cache with a TTL (refreshed on use): " +
                ", ".join(f"{t['ttl_s']:g}s {t['hit_ratio']:.1%}" for t in doc["ttl"])]
    tenants = doc["by_tenant"]
    if len(tenants) > 1:
        out += ["", "by tenant (bound): " + ", ".join(
            f"{t['name'] or '-'} {t['bound_hit_ratio']:.1%}" for t in sorted(tenants, key=lambda t: -t["prompt_tokens"])[:8])]
    if doc["top_prefixes"]:
        out += ["", "top shared prefixes by saved tokens:"]
        for p in doc["top_prefixes"][:5]:
            out.append(f"  {human(p['saved_tokens']):>7} saved, {p['requests']:>5} requests, "
                       f"{human(p['prefix_tokens'])} tokens: {_short(p['preview'])}")
    br = doc["breakers"]
    out.append("")
    if br.get("note"):
        out.append(f"breakers: {br['note']}")
    elif not br["found"]:
        out.append(f"breakers: none found in {br['sampled_requests']} sampled requests")
    else:
        out.append(f"breakers ({br['sampled_requests']} requests sampled):")
        for f in br["found"]:
            e = f["example"]
            per_day = f" ({human(f['lost_tokens_per_day'])}/day)" if f["lost_tokens_per_day"] else ""
            detail = f" ({_short(f['detail'], 60)})" if f["detail"] else ""
            out += [f"  [{f['kind']}]{detail} at token {f['start_token']}: {f['variants']} variants over "
                    f"{f['requests']} requests cost {human(f['lost_tokens'])} tokens{per_day}",
                    f"      {_short(e['before'], 30, tail=True)}[{_short(e['span_a'], 40)}]{_short(e['after'], 20)}",
                    f"   vs {_short(e['before'], 30, tail=True)}[{_short(e['span_b'], 40)}]{_short(e['after'], 20)}",
                    f"      fix: {f['fix']}"]
    if doc["cost"]:
        c = doc["cost"]
        out += ["", f"cost ({c['model']}, {c['input_per_mtok']} {cur}/M input, read x{c['cache_read_multiplier']:g}, "
                f"write x{c['cache_write_multiplier']:g}): {human(c['without_cache'])} {cur} without a cache; "
                f"the bound saves {human(c['bound_saved'])} {cur}"]
    out.append(f"(analysed in {doc['seconds']:.1f} s)")
    return "\n".join(out)
