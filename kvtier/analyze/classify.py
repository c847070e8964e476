"""Name the kind of a breaker from its divergent span and the text around it.

Kinds, tried in this order (the first that fits wins):
- ``whitespace``: the spans differ only in whitespace;
- ``json_reserialized``: the smallest JSON value enclosing the span parses to the same value
  on both sides (key order, spacing, number formatting);
- ``reordered_items``: that JSON value (or the span's characters) is a permutation of the
  other side's: tool definitions or list items in a different order;
- ``timestamp``, ``uuid``, ``number``: the span (widened to the surrounding word) matches a
  date/time, a UUID or long hex id, or differs only in digits;
- ``per_user_preamble``: the prompts diverge within the first ``early_tokens`` tokens and the
  span is other text: per-user content placed before shared content;
- ``unknown``: anything else.
Without a decoder (token-id logs with no tokenizer) only ``reordered_items`` (same token
multiset), ``per_user_preamble`` and ``unknown`` can be told apart.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

Decode = Callable[[np.ndarray], str]

FIXES = {
    "whitespace": "normalise whitespace before the prompt is assembled",
    "json_reserialized": "serialise JSON deterministically (sort_keys=True, fixed separators)",
    "reordered_items": "emit tools / list items in a fixed order (e.g. sorted by name)",
    "timestamp": "move the time after the shared prefix, or round it (e.g. to the day)",
    "uuid": "move request / session ids after the shared prefix",
    "number": "move changing numbers (counters, ids) after the shared prefix",
    "per_user_preamble": "put per-user text after the shared system prompt and tools",
    "unknown": "move the changing text after the shared prefix",
}

_TIME = re.compile(
    r"\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}(:\d{2})?|\b1\d{9}(\d{3})?\b|"
    r"\b(Mon|Tue|Wed|Thu|Fri|Sat|Sun|Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\b")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}|\b[0-9a-fA-F]{16,}\b")
_WORD = re.compile(r"[A-Za-z0-9:+\-./_]")
_DIGITS = re.compile(r"[\d.,:\-]+")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")


@dataclass(frozen=True)
class Classified:
    kind: str
    span_a: str  # the divergent text, as much of it as is decodable
    span_b: str
    before: str  # text just before the divergence
    after: str  # text just after the re-convergence
    detail: str = ""  # what differs, where the kind tells more (e.g. "key order, spacing")

    @property
    def fix(self) -> str:
        return FIXES[self.kind]


def _widen(text: str, lo: int, hi: int) -> str:
    while lo > 0 and _WORD.match(text[lo - 1]):
        lo -= 1
    while hi < len(text) and _WORD.match(text[hi]):
        hi += 1
    return text[lo:hi]


def _canon(x: Any) -> str:
    return json.dumps(x, sort_keys=True, separators=(",", ":"))


def _keys(x: Any) -> list[str]:
    """Every object key of a JSON value, in document order."""
    if isinstance(x, dict):
        return [k for key, v in x.items() for k in (key, *_keys(v))]
    if isinstance(x, list):
        return [k for v in x for k in _keys(v)]
    return []


def _json_detail(va: Any, vb: Any, ta: str, tb: str) -> str:
    """What differs between two texts of the same JSON value."""
    parts = []
    if _keys(va) != _keys(vb):
        parts.append("key order")
    if re.findall(r"\s+", ta) != re.findall(r"\s+", tb):
        parts.append("spacing")
    if sorted(re.findall(_NUMBER, ta)) != sorted(re.findall(_NUMBER, tb)):
        parts.append("number format")
    return ", ".join(parts) or "escaping"


def _json_kind(fa: str, fb: str, start: int, end_a: int, end_b: int) -> tuple[str, str] | None:
    """Parse the innermost JSON value enclosing the span on both sides (up to 8 levels out);
    (kind, what differs) when it tells."""
    dec = json.JSONDecoder()
    tried = 0
    for c in range(start - 1, -1, -1):
        if fa[c] not in "{[":
            continue
        try:
            va, ea = dec.raw_decode(fa, c)
            vb, eb = dec.raw_decode(fb, c)
        except ValueError:
            tried += 1
            if tried >= 8:
                return None
            continue
        if ea < end_a or eb < end_b:
            continue  # a value that closes before the span ends does not enclose it
        if va == vb:
            return "json_reserialized", _json_detail(va, vb, fa[c:ea], fb[c:eb])
        if isinstance(va, list) and isinstance(vb, list) and sorted(map(_canon, va)) == sorted(map(_canon, vb)):
            return "reordered_items", f"the same {len(va)} list items in another order"
        if isinstance(va, dict) and isinstance(vb, dict) and va.keys() == vb.keys() and all(
                va[k] == vb[k] or (isinstance(va[k], list) and isinstance(vb[k], list)
                                   and sorted(map(_canon, va[k])) == sorted(map(_canon, vb[k]))) for k in va):
            moved = [k for k in va if va[k] != vb[k]]
            return "reordered_items", f"items of {', '.join(map(repr, moved))} in another order"
        return None
    return None


def classify(head_a: np.ndarray, head_b: np.ndarray, start: int, end_a: int, end_b: int,
             decode: Decode | None, early_tokens: int = 64) -> Classified:
    """Classify the divergence ``head_a[start:end_a]`` vs ``head_b[start:end_b]``."""
    span_a, span_b = head_a[start:end_a], head_b[start:end_b]
    if decode is None:
        kind = ("reordered_items" if len(span_a) == len(span_b) and
                np.array_equal(np.sort(span_a), np.sort(span_b)) else
                "per_user_preamble" if start <= early_tokens else "unknown")
        fmt = " ".join
        return Classified(kind, fmt(map(str, span_a.tolist())), fmt(map(str, span_b.tolist())),
                          fmt(map(str, head_a[max(0, start - 8):start].tolist())),
                          fmt(map(str, head_a[end_a:end_a + 8].tolist())))
    fa, fb = decode(head_a), decode(head_b)
    s = len(decode(head_a[:start]))
    ea, eb = len(decode(head_a[:end_a])), len(decode(head_b[:end_b]))
    ta, tb = fa[s:ea], fb[s:eb]
    before, after = fa[max(0, s - 60):s], fa[ea:ea + 60]
    kind, detail = "unknown", ""
    wa, wb = _widen(fa, s, ea), _widen(fb, s, eb)
    if re.sub(r"\s+", "", ta) == re.sub(r"\s+", "", tb):
        kind = "whitespace"
    elif (jk := _json_kind(fa, fb, s, ea, eb)) is not None:
        kind, detail = jk
    elif len(ta) == len(tb) and sorted(ta) == sorted(tb) and len(ta) > 8:
        kind, detail = "reordered_items", "the same characters in another order"
    else:
        if _TIME.search(wa) and _TIME.search(wb):
            kind = "timestamp"
        elif _UUID.search(wa) and _UUID.search(wb):
            kind = "uuid"
        elif _DIGITS.fullmatch(ta.strip() or "x") and _DIGITS.fullmatch(tb.strip() or "x"):
            kind = "number"
        elif start <= early_tokens:
            kind = "per_user_preamble"
        detail = f"{wa[:60]!r} vs {wb[:60]!r}"
    return Classified(kind, ta, tb, before, after, detail)
