"""The usage report payload: a small JSON object, versioned, strictly validated.

    {"v": 1, "replica": "host-1234", "source": "hf", "model": "meta-llama/Llama-3-8B",
     "interval_s": 5.0, "uptime_s": 812.4, "seq": 162,
     "counters": {"prompt_tokens": 81920, "hit_tokens/cpu": 65536, ...},
     "top_prefixes": [["3fa1c29e0b7d4410", 40960, 83886080], ...]}

It travels as the raw request bytes of the ``ReportUsage`` RPC (kvtier.v1.KVTier, see
kvtier/server/servicer.py). There is no tenant field: the server takes the tenant from the
caller's bearer token. JSON, not protobuf, because the counter set is open (labels such as tiers
and miss reasons) and the payload is KiBs every few seconds; the decoder below bounds it.

:func:`decode_report` takes bytes from outside: it returns a :class:`UsageReport` or raises
:class:`ReportError` naming what is wrong, never anything else (hypothesis-fuzzed in
tests/test_usage.py).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.usage.counters import LABELLED, SCALARS, TOP_PREFIXES, PrefixFigures

VERSION = 1
MAX_REPORT_BYTES = 64 << 10
MAX_COUNTERS = 256
MAX_NAME_CHARS = {"replica": 128, "source": 64, "model": 256}
MAX_VALUE = float(1 << 62)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_LABEL = re.compile(r"^[^\x00-\x1f\x7f-\x9f/]{1,64}$")
_PREFIX = re.compile(r"^[0-9a-f]{1,16}$")
_SCALARS = frozenset(SCALARS)
_LABELLED = frozenset(LABELLED)


class ReportError(ValueError):
    """A payload that is not a valid usage report; the message says which part."""


@dataclass(frozen=True)
class UsageReport:
    """One decoded report: who (replica, source, model), how often it reports, and its
    cumulative counters (flat names, see kvtier.usage.counters)."""

    replica: str
    source: str
    model: str
    interval_s: float
    uptime_s: float
    seq: int
    counters: Mapping[str, float]
    top_prefixes: tuple[PrefixFigures, ...] = field(default=())


def encode_report(report: UsageReport) -> bytes:
    doc = {"v": VERSION, "replica": report.replica, "source": report.source, "model": report.model,
           "interval_s": report.interval_s, "uptime_s": round(report.uptime_s, 3), "seq": report.seq,
           "counters": dict(report.counters),
           "top_prefixes": [[p.prefix, p.hit_tokens, p.restored_bytes] for p in report.top_prefixes]}
    raw = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    if len(raw) > MAX_REPORT_BYTES:
        raise ReportError(f"report of {len(raw)} bytes exceeds {MAX_REPORT_BYTES}")
    return raw


def decode_report(raw: bytes | bytearray | memoryview) -> UsageReport:
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise ReportError("report: expected bytes")
    if len(raw) > MAX_REPORT_BYTES:
        raise ReportError(f"report of {len(raw)} bytes exceeds {MAX_REPORT_BYTES}")
    try:
        doc = json.loads(bytes(raw), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ReportError(f"report: not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ReportError("report: expected a JSON object")
    if doc.get("v") != VERSION:
        raise ReportError(f"report: version {doc.get('v')!r} unsupported (this server reads {VERSION})")
    names = {k: _name(doc, k, limit) for k, limit in MAX_NAME_CHARS.items()}
    interval = _number(doc.get("interval_s"), "interval_s")
    if not 0.01 <= interval <= 3600:
        raise ReportError(f"interval_s {interval} outside 0.01 .. 3600")
    seq = doc.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq <= MAX_VALUE:
        raise ReportError("seq: expected a non-negative integer")
    return UsageReport(names["replica"], names["source"], names["model"], interval,
                       _number(doc.get("uptime_s"), "uptime_s"), seq, _counters(doc.get("counters")),
                       _prefixes(doc.get("top_prefixes", [])))


def _no_constant(name: str) -> Any:
    raise ReportError(f"report: {name} is not a number")


def _name(doc: Mapping[str, Any], key: str, limit: int) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise ReportError(f"{key}: expected a string of 1 .. {limit} characters")
    if _CONTROL.search(value):
        raise ReportError(f"{key}: control characters are not allowed")
    return value


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReportError(f"{what}: expected a number")
    out = float(value)
    if not math.isfinite(out) or not 0 <= out <= MAX_VALUE:
        raise ReportError(f"{what}: {value!r} outside 0 .. 2**62")
    return out


def _counters(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        raise ReportError("counters: expected an object")
    if len(value) > MAX_COUNTERS:
        raise ReportError(f"counters: {len(value)} entries; at most {MAX_COUNTERS}")
    out: dict[str, float] = {}
    for name, v in value.items():
        base, sep, label = name.partition("/")
        if not (base in _SCALARS and not sep) and not (base in _LABELLED and _LABEL.match(label)):
            raise ReportError(f"counters: unknown counter name {name[:80]!r}")
        out[name] = _number(v, f"counters[{name!r}]")
    return out


def _prefixes(value: Any) -> tuple[PrefixFigures, ...]:
    if not isinstance(value, list) or len(value) > 2 * TOP_PREFIXES:
        raise ReportError(f"top_prefixes: expected a list of at most {2 * TOP_PREFIXES}")
    out = []
    for item in value:
        if not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], str) \
                or not _PREFIX.match(item[0]):
            raise ReportError("top_prefixes: expected [hex prefix, hit tokens, restored bytes] items")
        out.append(PrefixFigures(item[0], int(_number(item[1], "top_prefixes hits")),
                                 int(_number(item[2], "top_prefixes bytes"))))
    return tuple(out)


def report_of(replica: str, source: str, model: str, interval_s: float, uptime_s: float, seq: int,
              counters: Mapping[str, float], top: Sequence[PrefixFigures] = ()) -> UsageReport:
    """A report built locally (the reporter), checked by the same rules as a decoded one."""
    return decode_report(encode_report(UsageReport(replica, source, model, interval_s, uptime_s, seq,
                                                   counters, tuple(top))))
