"""The cluster dashboard's data: this node's /api/stats plus its peers', summarised per node
and tier (the document GET /api/cluster returns and /dashboard renders).

Two halves. The I/O half (:func:`fetch_stats`, :func:`gather`) asks every configured peer for
its ``/api/stats`` concurrently on the server's asyncio loop, each with one deadline covering
connect, request and reply; a peer that refuses, stalls, or answers garbage becomes a
:class:`PeerReply` with an error and shows as *down* -- it never raises and never holds the
page longer than the deadline. The pure half (:func:`node_summary`, :func:`cluster_document`)
turns stats documents into the dashboard document without I/O, so it is unit-tested directly.

Definitions (the dashboard and deploy/grafana use the same ones):
- ``hit_chunks`` / ``miss_chunks`` / ``hit_rate`` count Lookup probes only (Grafana's
  ``op="lookup"``); a lookup that stops at chunk i of n counts n - i misses under the reason it
  stopped. Get reads are counted apart (``read_hit_chunks``, ``read_miss_chunks``,
  ``read_miss_reasons``): a client reads the chunks its lookup found, so adding them in would
  count each hit twice and each miss once (a 50 % prefix read 67 %);
- a tier's hit rate is the share of the chunks that *reached* it (its hits, the hits of the
  tiers below it -- a lower tier the node does not list, ``redis``, included -- and the misses)
  that it served; a node's hit rate is hits / (hits + misses), the cluster's is the sum of the
  nodes' hits over the sum of their lookups (never an average of ratios);
- ``capacity_bytes`` of a tier is what the node can hold in it: the sum of its tenants'
  capacities, at most the node's budget for the tier (``capacity_bytes`` in /api/stats; tenants
  without a quota may each fill the whole budget, so the plain sum counts it once per tenant);
- ``used_bytes`` of a tier is counted as that capacity counts it, so used / capacity is at most
  1 and reaches 1 when the node must evict: where the budget is the capacity, the chunk bytes
  (``chunk_bytes``: the budget, kvtier.server.pool, counts those), else the tenants' own
  ``used_bytes`` (RAM: whole slots, which bound each tenant's tier). The RAM slots of several
  tenants over the budget read past 100 % with chunks smaller than a slot.
Stats from an older server that lacks these fields read as zeros (or the plain sum), never as
an error.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from kvtier.protocol.addresses import parse_hostport
from kvtier.server import usage_view

log = logging.getLogger(__name__)
PEER_TIMEOUT_S = 1.0  # per peer, connect to last byte; the page waits at most this long
MAX_REPLY_BYTES = 8 << 20  # a stats document is KiBs; anything bigger is not one


@dataclass(frozen=True)
class PeerReply:
    """One peer's answer: its stats document, or why there is none."""

    address: str
    doc: dict[str, Any] | None
    error: str = ""
    elapsed_s: float = 0.0


# --- I/O half --------------------------------------------------------------------------------

def parse_http_reply(raw: bytes, stats: bool = True) -> dict[str, Any]:
    """The JSON object of a complete ``HTTP/1.x 200`` reply (a /api/stats document unless
    ``stats`` is false); ValueError for anything else."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise ValueError("truncated reply")
    status = head.split(b"\r\n", 1)[0].split()
    if len(status) < 2 or not status[0].startswith(b"HTTP/"):
        raise ValueError("not an HTTP reply")
    if status[1] != b"200":
        raise ValueError(f"HTTP {status[1].decode('ascii', 'replace')}")
    try:
        doc = json.loads(body)
    except RecursionError:  # a peer's body nested deeper than the parser: not stats either
        raise ValueError("JSON nested too deep") from None
    if not isinstance(doc, dict) and not stats:
        raise ValueError("not a JSON object")  # noqa: TRY004 - bad peer data, not a caller bug
    if stats and (not isinstance(doc, dict) or not isinstance(doc.get("tenants"), list)):
        raise ValueError("not a kvtier /api/stats document")  # noqa: TRY004 - bad peer data, not a caller bug
    return doc


async def fetch_stats(address: str, timeout: float = PEER_TIMEOUT_S) -> PeerReply:
    """GET http://address/api/stats within ``timeout`` seconds. Never raises for a network or
    protocol failure: the reply then carries ``doc=None`` and the error text."""
    start = time.monotonic()
    try:
        doc = await asyncio.wait_for(_get(address, "/api/stats"), timeout)
    except asyncio.TimeoutError:
        error = f"no reply within {timeout:.3g}s"
    except ConnectionRefusedError:
        error = "connection refused"
    except OSError as exc:  # asyncio's connect errors carry the text in strerror, not errno's
        error = exc.strerror or str(exc) or type(exc).__name__
    except (ValueError, asyncio.IncompleteReadError) as exc:  # JSONDecodeError is a ValueError
        error = f"bad reply: {exc}"
    else:
        return PeerReply(address, doc, "", time.monotonic() - start)
    log.debug("peer %s down: %s", address, error)
    return PeerReply(address, None, error, time.monotonic() - start)


async def get_json(address: str, path: str) -> dict[str, Any]:
    """GET http://address/path: its JSON object (no deadline here: the caller sets one)."""
    return await _get(address, path, stats=False)


async def _get(address: str, path: str, stats: bool = True) -> dict[str, Any]:
    host, port = parse_hostport(address)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        raw = await reader.read(MAX_REPLY_BYTES + 1)
        while raw and len(raw) <= MAX_REPLY_BYTES:
            more = await reader.read(MAX_REPLY_BYTES + 1 - len(raw))
            if not more:
                break
            raw += more
        if len(raw) > MAX_REPLY_BYTES:
            raise ValueError(f"reply over {MAX_REPLY_BYTES} bytes")
        return parse_http_reply(raw, stats)
    finally:
        writer.close()


Resolve = Callable[[str, int], Awaitable[list[str]]]  # host, port -> its addresses


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system resolver, off the loop's thread)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


async def gather(peers: Sequence[str], timeout: float = PEER_TIMEOUT_S,
                 resolve: Resolve = resolve_host) -> list[PeerReply]:
    """Every peer's reply, fetched concurrently, in ``peers`` order; a peer whose host name
    has several addresses (a Kubernetes headless Service) is each of them (:func:`addresses`),
    all within ``timeout``."""
    groups = await asyncio.gather(*(_peer_replies(p, timeout, resolve) for p in peers))
    return [reply for group in groups for reply in group]


async def _peer_replies(peer: str, timeout: float, resolve: Resolve) -> list[PeerReply]:
    start = time.monotonic()
    targets = await addresses(peer, timeout, resolve)
    left = max(0.0, timeout - (time.monotonic() - start))
    return list(await asyncio.gather(*(fetch_stats(t, left) for t in targets)))


async def addresses(peer: str, timeout: float = PEER_TIMEOUT_S, resolve: Resolve = resolve_host) -> list[str]:
    """``peer`` as the ``host:port`` targets to ask: itself, or for a host name that resolves
    to several addresses (a headless Service listing every kvtier-server pod), one per address,
    IPv4 ones when there are any (a dual-stack name is one node per IPv4 address, and a node
    that listens on one family only must not show down on the other). A name that does not
    resolve stays as it is: its fetch fails and shows it down, with why."""
    host, port = parse_hostport(peer)
    try:
        ipaddress.ip_address(host)
        return [peer]
    except ValueError:
        pass
    try:
        found = set(await asyncio.wait_for(resolve(host, port), timeout))
    except (OSError, asyncio.TimeoutError):
        return [peer]
    v4 = sorted(a for a in found if ":" not in a)
    chosen = v4 or sorted(found)
    if len(chosen) <= 1:
        return [peer]
    return [f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in chosen]


async def cluster(local: dict[str, Any], peers: Sequence[str],
                  timeout: float = PEER_TIMEOUT_S) -> dict[str, Any]:
    """The /api/cluster document: ``local`` (this node's stats) and its peers'."""
    return cluster_document(local, await gather(peers, timeout))


def dashboard_html() -> bytes:
    """The page, shipped as package data: kvtier/server/static/dashboard.html with the
    scripts next to it (charts.js, dashboard.js) inlined at its SCRIPTS marker, so that one
    self-contained document is served (the CSP allows inline scripts only)."""
    static = resources.files("kvtier.server").joinpath("static")
    scripts = "\n".join(static.joinpath(name).read_text() for name in ("charts.js", "dashboard.js"))
    if "</script" in scripts.lower():
        raise ValueError("a dashboard script contains '</script': it would end the inline block")
    page = static.joinpath("dashboard.html").read_text()
    return page.replace("<!--SCRIPTS-->", f"<script>\n{scripts}</script>", 1).encode()


# --- pure half -------------------------------------------------------------------------------

def _sum(values: Mapping[str, Any] | None) -> int:
    return sum(int(v) for v in (values or {}).values())


def _rate(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


# Per-node counts summed over tenants (then over nodes); hit/miss are lookups', read_* Gets'.
_NODE_COUNTS = ("hit_chunks", "miss_chunks", "lookups", "read_hit_chunks", "read_miss_chunks", "bytes_in",
                "bytes_out")


def node_summary(doc: Mapping[str, Any], address: str = "", latency_s: float = 0.0) -> dict[str, Any]:
    """One node's dashboard entry from its /api/stats document: tiers summed over tenants
    (in the order the node stacks them, fastest first), tenants, and node totals."""
    tiers: dict[str, dict[str, Any]] = {}
    tenants: list[dict[str, Any]] = []
    misses: Counter[str] = Counter()
    read_misses: Counter[str] = Counter()
    hits_by_tier: Counter[str] = Counter()
    totals: Counter[str] = Counter()
    for t in doc.get("tenants", ()):
        lookup, get = t.get("lookup") or {}, t.get("get") or {}
        t_hits = _sum(lookup.get("hit_chunks"))
        t_miss = Counter({str(k): int(v) for k, v in (lookup.get("miss_chunks") or {}).items()})
        t_read_miss = Counter({str(k): int(v) for k, v in (get.get("miss_chunks") or {}).items()})
        misses.update(t_miss)
        read_misses.update(t_read_miss)
        hits_by_tier.update({str(k): int(v) for k, v in (lookup.get("hit_chunks") or {}).items()})
        for tier in t.get("tiers", ()):
            agg = tiers.setdefault(tier["name"], {"name": tier["name"], "used_bytes": 0, "chunk_bytes": 0,
                                                  "capacity_bytes": 0, "entries": 0, "hit_chunks": 0,
                                                  "evictions": Counter()})
            for k in ("used_bytes", "capacity_bytes", "entries"):
                agg[k] += int(tier.get(k, 0))
            # An older server's tiers lack chunk_bytes; its used_bytes counted chunk bytes then.
            agg["chunk_bytes"] += int(tier.get("chunk_bytes", tier.get("used_bytes", 0)))
            agg["evictions"].update({str(k): int(v) for k, v in (tier.get("evictions") or {}).items()})
        tenants.append({
            "tenant": t.get("tenant", "?"), "used_bytes": int(t.get("used_bytes", 0)),
            "quota_bytes": int(t.get("quota_bytes", 0)), "entries": int(t.get("entries", 0)),
            "evictions": int(t.get("evictions", 0)), "hit_chunks": t_hits, "miss_chunks": sum(t_miss.values()),
            "hit_rate": _rate(t_hits, sum(t_miss.values())), "lookups": int(lookup.get("requests", 0)),
            "read_hit_chunks": _sum(get.get("hit_chunks")), "read_miss_chunks": sum(t_read_miss.values()),
            "bytes_in": int(t.get("bytes_in", 0)), "bytes_out": int(t.get("bytes_out", 0))})
        totals.update({k: tenants[-1][k] for k in _NODE_COUNTS})
    budgets = doc.get("capacity_bytes")
    budgets = budgets if isinstance(budgets, dict) else {}
    tier_list = list(tiers.values())
    # Chunks that reached a tier = its hits + hits of the tiers below (listed or not) + misses.
    below = sum(misses.values()) + sum(n for name, n in hits_by_tier.items() if name not in tiers)
    for agg in reversed(tier_list):
        agg["hit_chunks"] = hits_by_tier[agg["name"]]
        below += agg["hit_chunks"]
        agg["hit_rate"] = _rate(agg["hit_chunks"], below - agg["hit_chunks"])
        agg["evictions"] = dict(agg["evictions"])
        # Tenants whose capacities add up past the node's budget share it: the node holds it once,
        # and counts chunk bytes against it (kvtier.server.pool), so used is their chunk bytes;
        # within the budget each tenant's own tier bounds it, counted as used_bytes (RAM: slots).
        if agg["name"] in budgets and agg["capacity_bytes"] > int(budgets[agg["name"]]):
            agg["capacity_bytes"] = int(budgets[agg["name"]])
            agg["used_bytes"] = agg["chunk_bytes"]
    # The bottom tier bounds what a node holds (RAM caches it when there is a disk).
    bottom = tier_list[-1] if tier_list else {"used_bytes": 0, "capacity_bytes": 0, "entries": 0}
    evictions: Counter[str] = Counter()
    for agg in tier_list:
        evictions.update(agg["evictions"])
    return {
        "node_id": str(doc.get("node_id", address)), "address": address, "up": True, "error": "",
        "draining": bool(doc.get("draining", False)), "version": str(doc.get("version", "")),
        "uptime_s": float(doc.get("uptime_s", 0.0)), "latency_ms": round(latency_s * 1000, 1),
        "tiers": tier_list, "tenants": tenants,
        "totals": {"used_bytes": bottom["used_bytes"], "capacity_bytes": bottom["capacity_bytes"],
                   "entries": bottom["entries"], **{k: totals[k] for k in _NODE_COUNTS},
                   "hit_rate": _rate(totals["hit_chunks"], totals["miss_chunks"]),
                   "miss_reasons": dict(misses), "read_miss_reasons": dict(read_misses),
                   "evictions": dict(evictions)},
    }


def down_node(reply: PeerReply) -> dict[str, Any]:
    """A node that did not answer: shown, marked down, with why."""
    return {"node_id": reply.address, "address": reply.address, "up": False, "error": reply.error,
            "draining": False, "version": "", "uptime_s": 0.0, "latency_ms": round(reply.elapsed_s * 1000, 1),
            "tiers": [], "tenants": [], "totals": {}}


def _peer_summary(reply: PeerReply) -> dict[str, Any]:
    """A peer's entry; a document that is JSON but not shaped like /api/stats (``"used_bytes":
    "lots"``, a tier without ``name``) makes that peer down with the reason, never the page."""
    assert reply.doc is not None
    try:
        summary = node_summary(reply.doc, reply.address, reply.elapsed_s)
        json.dumps(summary)  # what the page serves must serialise
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        log.info("peer %s: bad /api/stats document: %r", reply.address, exc)
        return down_node(PeerReply(reply.address, None, f"bad stats document: {type(exc).__name__}: {exc}",
                                   reply.elapsed_s))
    return summary


def cluster_document(local: Mapping[str, Any], replies: Iterable[PeerReply],
                     now: float | None = None) -> dict[str, Any]:
    """This node first, then each peer in order (a peer that is this node, or a node already
    listed, is dropped: every node can be given the same list, and a node named twice is
    counted once), and cluster totals over the nodes that are up."""
    me = str(local.get("node_id", ""))
    nodes = [node_summary(local, "self")]
    usage = [(me, local.get("usage") or {})]
    seen = {me}  # a node reached under two addresses (a name and its IP, v4 and v6) counts once
    for reply in replies:
        if reply.doc is None:
            nodes.append(down_node(reply))
        elif str(reply.doc.get("node_id", reply.address)) not in seen:
            seen.add(str(reply.doc.get("node_id", reply.address)))
            nodes.append(_peer_summary(reply))
            if nodes[-1]["up"] and _usage_ok(reply.doc.get("usage")):
                usage.append((nodes[-1]["node_id"], reply.doc["usage"]))
    up = [n for n in nodes if n["up"]]
    total: Counter[str] = Counter()
    evictions: Counter[str] = Counter()
    misses: Counter[str] = Counter()
    read_misses: Counter[str] = Counter()
    tiers: dict[str, Counter[str]] = {}
    for n in up:
        t = n["totals"]
        total.update({k: t[k] for k in ("used_bytes", "capacity_bytes", "entries", *_NODE_COUNTS)})
        evictions.update(t["evictions"])
        misses.update(t["miss_reasons"])
        read_misses.update(t["read_miss_reasons"])
        for tier in n["tiers"]:
            agg = tiers.setdefault(tier["name"], Counter())
            agg.update({k: tier[k] for k in ("used_bytes", "capacity_bytes", "entries", "hit_chunks")})
            agg["evictions"] += sum(tier["evictions"].values())
    return {
        "generated_at": time.time() if now is None else now, "self": me,
        "nodes_up": len(up), "nodes_down": len(nodes) - len(up), "nodes": nodes,
        "totals": {**{k: total[k] for k in ("used_bytes", "capacity_bytes", "entries", *_NODE_COUNTS)},
                   "hit_rate": _rate(total["hit_chunks"], total["miss_chunks"]),
                   "evictions": dict(evictions), "miss_reasons": dict(misses),
                   "read_miss_reasons": dict(read_misses)},
        "tiers": [{"name": name, **dict(c)} for name, c in tiers.items()],
        "engines": usage_view.engines_document(usage),
    }


def _usage_ok(usage: Any) -> bool:
    """A peer's ``usage`` section merges (an older peer has none: nothing to merge)."""
    if not isinstance(usage, dict):
        return False
    try:
        usage_view.engines_document([("peer", usage)])
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        log.info("peer usage section ignored: %r", exc)
        return False
    return True
