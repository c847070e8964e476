"""The self-contained HTML report: one page, figures embedded as base64 PNGs, no CDN, no script.

Every string from the log (prompt text in breakers and previews) is HTML-escaped.
"""

from __future__ import annotations

import html
import json
from typing import Any

from kvtier.analyze import plots
from kvtier.analyze.report import capacity, human

_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:980px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td.l{text-align:left}pre{background:#f7f7f7;padding:8px;white-space:pre-wrap;word-break:break-all}
mark{background:#ffd54f}.kind{font-weight:bold;color:#c0392b}img{max-width:100%}"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _img(uri: str | None, alt: str) -> str:
    return f'<p><img alt="{_e(alt)}" src="{uri}"></p>' if uri else ""


def _curve_table(doc: dict[str, Any]) -> str:
    names = doc["policies"]
    by = {(p["policy"], p["capacity_tokens"]): p for p in doc["curve"]}
    cur = doc["cost"]["currency"] if doc["cost"] else None
    head = "".join(f"<th>{_e(n)}</th>" for n in names) + (f"<th>{_e(doc['default_policy'])} saves ({_e(cur)}{'/day' if doc['log']['duration_s'] else ''})</th>" if cur else "")
    rows = []
    for c in sorted({p["capacity_tokens"] for p in doc["curve"]}):
        cells = "".join(f"<td>{by[(n, c)]['hit_ratio']:.1%}</td>" for n in names)
        if cur:
            d = by[(doc["default_policy"], c)]
            m = d["money_saved_per_day"] if d["money_saved_per_day"] is not None else d["money_saved"]
            cells += f"<td>{m:,.2f}</td>"
        rows.append(f"<tr><td>{_e(capacity(by[(names[0], c)]))}</td>{cells}</tr>")
    return f"<table><tr><th>capacity (tokens)</th>{head}</tr>{''.join(rows)}</table>"


def _breakers(doc: dict[str, Any]) -> str:
    br = doc["breakers"]
    if br.get("note"):
        return f"<p>{_e(br['note'])}</p>"
    if not br["found"]:
        return f"<p>No breakers found in {br['sampled_requests']} sampled requests.</p>"
    items = []
    for f in br["found"]:
        e = f["example"]
        per_day = f" ({human(f['lost_tokens_per_day'])} per day)" if f["lost_tokens_per_day"] else ""
        items.append(
            f"<li><span class=kind>{_e(f['kind'])}</span>"
            f"{' (' + _e(f['detail']) + ')' if f['detail'] else ''} at token {f['start_token']}: "
            f"{f['variants']} variants over {f['requests']} requests cost {human(f['lost_tokens'])} "
            f"tokens{per_day}. Fix: {_e(f['fix'])}"
            f"<pre>…{_e(e['before'])}<mark>{_e(e['span_a'])}</mark>{_e(e['after'])}…</pre>"
            f"<pre>…{_e(e['before'])}<mark>{_e(e['span_b'])}</mark>{_e(e['after'])}…</pre></li>")
    return f"<ol>{''.join(items)}</ol>"


def render(doc: dict[str, Any]) -> str:
    """The whole page for an analysis document."""
    lg, b = doc["log"], doc["bound"]
    prefixes = "".join(f"<tr><td>{human(p['saved_tokens'])}</td><td>{p['requests']}</td>"
                       f"<td>{human(p['prefix_tokens'])}</td><td class=l>{_e(p['preview'])}</td></tr>"
                       for p in doc["top_prefixes"])
    tenants = "".join(f"<tr><td class=l>{_e(t['name'] or '-')}</td><td>{t['requests']}</td>"
                      f"<td>{human(t['prompt_tokens'])}</td><td>{t['bound_hit_ratio']:.1%}</td></tr>"
                      for t in doc["by_tenant"])
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvtier analyze: {_e(lg['path'])}</title>
<style>{_CSS}</style></head><body>
<h1>Prefix-cache analysis</h1>
<p>{_e(lg['path'])} ({_e(lg['format'])}): {lg['requests']} requests, {human(lg['prompt_tokens'])} prompt tokens.
A perfect prefix cache serves <b>{b['hit_ratio']:.1%}</b> of prompt tokens and needs {human(b['distinct_tokens'])} tokens of KV.</p>
<h2>Hit ratio and savings by capacity</h2>
{_img(plots.hit_ratio(doc), "hit ratio by capacity")}
{_curve_table(doc)}
{_img(plots.savings(doc), "savings by capacity")}
{_img(plots.ttl(doc), "hit ratio by TTL")}
<h2>Cache breakers</h2>
{_img(plots.breakers(doc), "breakers")}
{_breakers(doc)}
<h2>Top shared prefixes</h2>
<table><tr><th>saved tokens</th><th>requests</th><th>prefix tokens</th><th>preview</th></tr>{prefixes}</table>
<h2>Tenants</h2>
<table><tr><th>tenant</th><th>requests</th><th>prompt tokens</th><th>bound</th></tr>{tenants}</table>
<details><summary>JSON document</summary><pre>{_e(json.dumps(doc, indent=1))}</pre></details>
</body></html>
"""
