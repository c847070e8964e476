"""``kvtier top``: the cluster dashboard's figures as a live terminal table.

    kvtier top                                   # 127.0.0.1:50052 and the peers it knows
    kvtier top --server 10.0.0.5:50052 --server 10.0.0.6:50052
    kvtier top --once --json | jq .engines.totals.hit_ratio

The document is /api/cluster's (kvtier.server.dashboard, usage_view). One ``--server``: that
node's /api/cluster (it asks its own ``peers``). Several: their /api/stats, merged here by the
same code the server runs, so nodes that do not list each other still make one picture.
Refreshes in place every ``--interval`` seconds (rich when installed, else plain ANSI) until
Ctrl-C. ``--once`` prints one table; ``--json`` one JSON document. Exit status 1 when no server
answered (``--once``), else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvtier.protocol.addresses import parse_hostport
from kvtier.server import dashboard

log = logging.getLogger(__name__)
DEFAULT_SERVER = "127.0.0.1:50052"
Table = tuple[str, list[str], list[list[str]]]  # title, headers, rows


def _server(text: str) -> str:
    try:
        parse_hostport(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (e.g. 127.0.0.1:50052)") from None
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text}")
    return value


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("top", help="live table of the cluster: engine hit ratios, replicas, nodes",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", action="append", metavar="HOST:HTTP_PORT", type=_server,
                   help=f"a kvtier-server HTTP side port (repeatable; default {DEFAULT_SERVER})")
    p.add_argument("--interval", type=_seconds, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--once", action="store_true", help="print once and exit")
    p.add_argument("--json", action="store_true", help="with --once: the /api/cluster JSON document")
    p.add_argument("--timeout", type=_seconds, default=dashboard.PEER_TIMEOUT_S * 2,
                   help="seconds to wait for each server")
    p.set_defaults(handler=run)


def fetch(servers: Sequence[str], timeout: float) -> dict[str, Any] | None:
    """The cluster document, or None when no server answered."""
    for s in servers:
        parse_hostport(s)  # ValueError names a bad --server
    return asyncio.run(_fetch(servers, timeout))


async def _fetch(servers: Sequence[str], timeout: float) -> dict[str, Any] | None:
    if len(servers) == 1:
        try:
            doc = await asyncio.wait_for(dashboard.get_json(servers[0], "/api/cluster"), timeout)
        except (OSError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            log.debug("%s: %s", servers[0], exc)
            return None
        return doc
    replies = await dashboard.gather(servers, timeout)
    up = [r for r in replies if r.doc is not None]
    if not up:
        return None
    assert up[0].doc is not None
    return dashboard.cluster_document(up[0].doc, [r for r in replies if r is not up[0]])


def _pct(r: float | None) -> str:
    return "-" if r is None else f"{100 * r:.1f}%"


def _n(v: float | None) -> str:
    v = v or 0
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if v >= div * 10:
            return f"{v / div:.1f}{unit}"
    return str(int(v))


def _b(v: float | None) -> str:
    v = float(v or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return ""


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def headline(doc: dict[str, Any]) -> str:
    e = doc.get("engines") or {}
    t = e.get("totals") or {}
    return (f"kvtier cluster via {doc.get('self', '?')}  |  prompt-token hit ratio {_pct(t.get('hit_ratio'))} "
            f"({_n(t.get('hit_tokens'))}/{_n(t.get('prompt_tokens'))})  prefill saved {_n(t.get('prefill_tokens_saved'))} tok  "
            f"TTFT hit/miss {_ms(t.get('ttft_ms_hit'))}/{_ms(t.get('ttft_ms_miss'))}  |  replicas {e.get('reporting', 0)} "
            f"reporting, {len(e.get('stopped', []))} stopped  |  nodes {doc.get('nodes_up', 0)} up, "
            f"{doc.get('nodes_down', 0)} down")


def tables(doc: dict[str, Any]) -> list[Table]:
    """The figures of the page as (title, headers, rows): every value already text."""
    e = doc.get("engines") or {}
    t = e.get("totals") or {}
    out: list[Table] = [("replicas", ["replica", "model", "tenant", "hit ratio", "prompt tok", "restored tok",
                                      "TTFT hit", "TTFT miss", "state", "nodes"],
                         [[r["replica"], r["model"], r["tenant"], _pct(r["hit_ratio"]), _n(r["prompt_tokens"]),
                           _n(r["restored_tokens"]), _ms(r["ttft_ms_hit"]), _ms(r["ttft_ms_miss"]),
                           f"stopped {r['age_s']:.0f}s ago" if r["stale"] else "reporting", str(len(r["nodes"]))]
                          for r in e.get("replicas", [])])]
    out.append(("models", ["model", "hit ratio", "prompt tok", "hit tok", "restored"],
                [[m["model"], _pct(m["hit_ratio"]), _n(m["prompt_tokens"]), _n(m["hit_tokens"]),
                  _b(m["restored_bytes"])] for m in e.get("models", [])]))
    hits = [[f"hit: {k}", _n(v)] for k, v in sorted((t.get("hits_per_tier") or {}).items())]
    misses = [[f"miss: {k}", _n(v)] for k, v in sorted((t.get("misses_per_reason") or {}).items())]
    out.append(("prompt tokens by tier and miss reason", ["", "tokens"], hits + misses))
    rows = []
    for n in doc.get("nodes", []):
        if not n.get("up"):
            rows.append([n["node_id"], "DOWN", n.get("error", ""), "", "", ""])
            continue
        tiers = "  ".join(f"{x['name']} {_b(x['used_bytes'])}/{_b(x['capacity_bytes'])}" for x in n["tiers"])
        tot = n["totals"]
        evictions = ", ".join(f"{k} {_n(v)}" for k, v in (tot.get("evictions") or {}).items()) or "0"
        rows.append([n["node_id"], "draining" if n.get("draining") else "up", tiers, _pct(tot.get("hit_rate")),
                     f"{_b(tot.get('bytes_in'))} / {_b(tot.get('bytes_out'))}", evictions])
    out.append(("nodes", ["node", "state", "used / capacity per tier", "chunk hits", "in / out", "evictions"], rows))
    return out


def render_text(doc: dict[str, Any]) -> str:
    parts = [headline(doc)]
    for title, headers, rows in tables(doc):
        cells = [headers, *rows]
        widths = [max(len(_clean(r[i])) for r in cells) for i in range(len(headers))]
        parts.append(f"\n{title}")
        parts += ["  ".join(_clean(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
        if not rows:
            parts.append("  (none yet)")
    return "\n".join(parts)


def _clean(text: str) -> str:
    """Names come from outside: no control character reaches the terminal."""
    return "".join(c if c.isprintable() else "?" for c in str(text))


def _rich(doc: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table as RichTable
    from rich.text import Text

    items: list[Any] = [Text(_clean(headline(doc)), style="bold")]
    for title, headers, rows in tables(doc):
        table = RichTable(title=title, title_justify="left", expand=False)
        for h in headers:
            table.add_column(h)
        for r in rows:
            table.add_row(*(Text(_clean(c), style="red" if c in ("DOWN",) or c.startswith("stopped") else "")
                            for c in r))  # Text: names are never read as rich markup
        items.append(table)
    return Group(*items)


def run(ns: argparse.Namespace) -> int:
    servers = ns.server or [DEFAULT_SERVER]
    if ns.once:
        doc = fetch(servers, ns.timeout)
        if doc is None:
            print(f"kvtier top: no answer from {', '.join(servers)}", file=sys.stderr)
            return 1
        print(json.dumps(doc) if ns.json else render_text(doc))
        return 0
    try:
        _live(servers, ns.interval, ns.timeout)
    except KeyboardInterrupt:
        pass
    return 0


def _live(servers: Sequence[str], interval: float, timeout: float) -> None:
    def frame() -> Any:
        doc = fetch(servers, timeout)
        return doc if doc is not None else {"self": "?", "nodes": [], "error": f"no answer from {', '.join(servers)}"}

    try:
        from rich.live import Live
    except ImportError:
        while True:  # plain ANSI: home the cursor, clear, redraw
            sys.stdout.write("\x1b[H\x1b[2J" + render_text(frame()) + "\n")
            sys.stdout.flush()
            time.sleep(interval)
    with Live(_rich(frame()), auto_refresh=False, screen=False) as live:
        while True:
            time.sleep(interval)
            live.update(_rich(frame()), refresh=True)
