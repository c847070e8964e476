"""Read a request log (JSONL) into a :class:`~kvtier.analyze.records.Log`.

One JSON object per line (UTF-8, optionally gzip-compressed); blank lines are skipped. Each
line is one of:
- token ids: ``prompt_token_ids`` | ``token_ids`` | ``input_ids`` | ``tokens`` (list of ints);
- text: ``prompt`` | ``text`` (string) or ``messages`` (chat list of ``{role, content}``),
  tokenized with ``--tokenizer`` (a local tokenizer directory; nothing is downloaded);
- a Mooncake trace line: ``hash_ids`` (one id per ``block_tokens`` = 512-token block, already
  prefix-chained) and ``input_length``; its ``timestamp`` is in milliseconds. Its chunks are
  those blocks, whatever ``chunk_tokens`` says (a warning says so when one was given). An id
  that follows two different ids (or starts one prompt and follows an id in another) is not
  prefix-chained: per-block content hashes would make every figure meaningless (a block seen
  anywhere would count as a prefix hit), so a trace where more than 1% of the blocks read do so
  is refused; a few such glitches only warn.
Optional on any line: ``timestamp`` (seconds, or an ISO-8601 string; years 1 to 9999),
``tenant`` (or ``user``) and ``model`` (strings), ``output_length`` | ``output_tokens``. A
malformed line raises :class:`LogError` naming the file, the line number and what is wrong.

The requests are returned in replay order: timestamp order (see
:func:`~kvtier.analyze.records.time_order`), with a warning counting those the file had out of
order.

Token logs are keyed with kvtier's own chain (:func:`kvtier.keys.chunk_keys`, sha256, one
namespace per model, and per tenant with ``isolate_tenants`` as a salted deployment would).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kvtier.analyze.records import Log, Request, time_order
from kvtier.errors import not_utf8
from kvtier.keys import KVLayout, NamespaceSpec, chunk_keys, namespace_id

TOKEN_FIELDS = ("prompt_token_ids", "token_ids", "input_ids", "tokens")
TEXT_FIELDS = ("prompt", "text")
MOONCAKE_BLOCK_TOKENS = 512
#: Tokens of each prompt kept for breaker detection and display.
DEFAULT_HEAD_TOKENS = 4096
Encoder = Callable[[list[str]], list[list[int]]]
DEFAULT_CHUNK_TOKENS = 256  # kvtier's
# Seconds since 1970 that an ISO-8601 timestamp can name (years 1 to 9999): a number outside is
# a unit or typo error (1e308 ms would make a 1e305 s log and every per-day rate 0).
MIN_EPOCH_S, MAX_EPOCH_S = -62_135_596_800.0, 253_402_300_800.0
log = logging.getLogger(__name__)


class LogError(ValueError):
    """The log (or the tokenizer it needs) cannot be read; the message says where and why."""


def load_tokenizer(path: str) -> Any:
    """A transformers tokenizer from a local directory (``local_files_only``: no download)."""
    if not Path(path).is_dir():
        raise LogError(f"--tokenizer {path!r}: not a directory (a local tokenizer directory is needed; nothing is downloaded)")
    from transformers import AutoTokenizer  # heavy: only when a text log needs it

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise LogError(f"--tokenizer {path!r}: cannot load a tokenizer from it: {exc}") from exc


def _encoder(tokenizer: Any) -> Encoder:
    def encode(texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return encode


def _messages_text(tokenizer: Any, messages: Any, where: str) -> str:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise LogError(f"{where}: 'messages' must be a list of {{role, content}} objects")
    if getattr(tokenizer, "chat_template", None):
        import jinja2  # transformers' own dependency, present whenever a tokenizer is

        try:
            return str(tokenizer.apply_chat_template(messages, tokenize=False))
        except jinja2.TemplateError as exc:  # e.g. raise_exception() on non-alternating roles
            raise LogError(f"{where}: the tokenizer's chat template rejects these messages: {exc}") from None
    return "".join(f"<|{m.get('role', '')}|>\n{m.get('content', '')}\n" for m in messages)


def _timestamp(value: Any, scale: float, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise LogError(f"{where}: 'timestamp' must be a number or an ISO-8601 string")
    if isinstance(value, (int, float)):
        try:
            seconds = float(value) * scale
        except OverflowError:  # an int too large for a float
            seconds = math.inf
        # NaN/Infinity (Python's json reads them) would turn the durations and rates into NaN.
        if not math.isfinite(seconds):
            raise LogError(f"{where}: 'timestamp' {value!r} is not a finite number")
        if not MIN_EPOCH_S <= seconds < MAX_EPOCH_S:
            unit = "ms" if scale != 1.0 else "s"
            raise LogError(f"{where}: 'timestamp' {value!r} ({unit}) is out of range: not within "
                           f"years 1 to 9999 as seconds since 1970")
        return seconds
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except (ValueError, OverflowError):
            raise LogError(f"{where}: 'timestamp' {value!r} is not ISO-8601") from None
    raise LogError(f"{where}: 'timestamp' must be a number or an ISO-8601 string")


def _int_list(value: Any, name: str, where: str, bits: int) -> list[int]:
    """``value`` as a list of integers in [0, 2**bits): token ids are uint32, Mooncake hash ids
    8 key bytes; a larger one would fail deep in the keying with no line to name."""
    if not isinstance(value, list):
        raise LogError(f"{where}: {name!r} must be a list of non-negative integers")
    limit = 1 << bits
    for i, v in enumerate(value):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < limit:
            raise LogError(f"{where}: {name!r} must be a list of non-negative integers below "
                           f"2**{bits}; item {i} is {v!r:.40}")
    return value


def json_lines(path: Path, progress: bool = False) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) per non-blank line of a JSONL file, gzip-compressed or not;
    :class:`LogError` naming the file and line for one that is not a JSON object."""
    with path.open("rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"  # the gzip magic, whatever the file's name
    # A gzip stream's uncompressed size is not known up front: the bar then only counts.
    total = None if gzipped else path.stat().st_size
    lineno = 0
    with (gzip.open(path, "rb") if gzipped else path.open("rb")) as f, \
            tqdm(total=total, unit="B", unit_scale=True, desc="read", disable=not progress, leave=False) as bar:
        try:
            for lineno, raw in enumerate(f, 1):
                bar.update(len(raw))
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except UnicodeDecodeError as exc:
                    raise LogError(f"{path}:{lineno}: {not_utf8(exc, 'column')}") from None
                except json.JSONDecodeError as exc:
                    raise LogError(f"{path}:{lineno}: not JSON: {exc.msg}") from None
                except RecursionError:  # json's decoder recurses per level of [ or {
                    raise LogError(f"{path}:{lineno}: JSON nested too deeply to read") from None
                if not isinstance(obj, dict):
                    raise LogError(f"{path}:{lineno}: each line must be a JSON object")
                yield lineno, obj
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:  # a corrupt or truncated .gz
            raise LogError(f"{path}:{lineno + 1}: cannot decompress: {exc}") from None


def _label(obj: dict[str, Any], name: str, where: str) -> str:
    """A ``tenant`` / ``user`` / ``model`` field: a string, or "" when absent or null. Anything
    else is refused rather than turned into its str(): 5 and "5" would merge, an object would
    become its repr."""
    value = obj.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise LogError(f"{where}: {name!r} must be a string, got {type(value).__name__} {value!r:.40}")
    return value


CHAIN_CONFLICTS_TOLERATED = 0.01  # of the blocks read: a few glitches warn, a pattern refuses


class _Chains:
    """Mooncake block ids, each kept as one key object (a trace repeats its ids: one object per
    distinct block saves more than this dict costs) with the id before it. Prefix-chained ids
    name a whole prefix, so each has exactly one id before it (which also fixes its depth);
    per-block content hashes do not, and would count a block seen under any other prefix as a
    hit: :meth:`check` refuses a log where more than ``CHAIN_CONFLICTS_TOLERATED`` of the blocks
    read follow another id than the first time, and warns below that (a trace's own glitches
    must not make it unreadable)."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, tuple[bytes, bytes]] = {}
        self.read = self.conflicts = 0
        self.first = ""

    def keys(self, keys: list[bytes], where: str) -> tuple[bytes, ...]:
        parent = b""
        for i, key in enumerate(keys):
            kept, before = self.blocks.setdefault(key, (key, parent))
            if before is not parent and before != parent:
                self.conflicts += 1
                if not self.first:
                    self.first = (f"{where}: 'hash_ids' are not prefix-chained: item {i} (id {_block_id(key)}) "
                                  f"{_place(parent)} here but {_place(before)} earlier in the log")
            keys[i] = parent = kept
        self.read += len(keys)
        return tuple(keys)

    def check(self, path: Path) -> None:
        if not self.conflicts:
            return
        share = self.conflicts / max(1, self.read)
        if share > CHAIN_CONFLICTS_TOLERATED:
            raise LogError(
                f"{self.first} ({self.conflicts} of {self.read} blocks so); each id must name the whole "
                f"prefix up to its block, as in Mooncake traces (per-block content hashes would count a "
                f"block seen under any other prefix as a hit, so no figure would hold)")
        log.warning("%s: %d of %d blocks follow another id than where they first appeared (first: %s); "
                    "figures may overstate reuse by up to that share", path, self.conflicts, self.read,
                    self.first)


def _block_id(key: bytes) -> int:
    """The trace's id back from a Mooncake key (8 namespace bytes, then the id)."""
    return int.from_bytes(key[8:], "little")


def _place(parent: bytes) -> str:
    return f"follows id {_block_id(parent)}" if parent else "starts a prompt"


class _Keyer:
    """Chunk keys per (model, tenant) namespace, with kvtier's chain."""

    def __init__(self, chunk_tokens: int, isolate_tenants: bool) -> None:
        self.chunk_tokens = chunk_tokens
        self._isolate = isolate_tenants
        self._ns: dict[tuple[str, str], bytes] = {}

    def namespace(self, model: str, tenant: str) -> bytes:
        key = (model, tenant if self._isolate else "")
        ns = self._ns.get(key)
        if ns is None:
            salt = hashlib.sha256(key[1].encode()).digest() if key[1] else b""
            spec = NamespaceSpec(model or "log", KVLayout(1, 1, 1, self.chunk_tokens), salt=salt)
            ns = self._ns[key] = namespace_id(spec)
        return ns

    def keys(self, tokens: Sequence[int], model: str, tenant: str) -> tuple[bytes, ...]:
        return tuple(chunk_keys(self.namespace(model, tenant), tokens, self.chunk_tokens))


def read_log(path: str | Path, *, tokenizer: Any = None, chunk_tokens: int | None = None,
             head_tokens: int = DEFAULT_HEAD_TOKENS, keep_heads: int = 3000,
             isolate_tenants: bool = False, progress: bool = False) -> Log:
    """Read ``path``; see the module docstring for the accepted lines. Formats may not be mixed.

    The first ``head_tokens`` tokens are kept for between ``keep_heads`` and twice as many
    requests, evenly spread over the log (every ``stride``-th request; the stride doubles as
    the log grows), so memory stays bounded on long logs.

    ``chunk_tokens``: tokens per chunk (default 256, kvtier's); a Mooncake trace keeps its
    512-token blocks, with a warning when ``chunk_tokens`` was given otherwise.

    ``tokenizer`` (see :func:`load_tokenizer`) is needed only for text lines. Raises
    :class:`LogError` for a missing file, a malformed line, or an empty log.
    """
    p = Path(path)
    if not p.is_file():
        raise LogError(f"log {str(p)!r}: no such file")
    chunk = DEFAULT_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    if chunk < 1:
        raise LogError(f"--chunk-tokens must be >= 1, got {chunk}")
    keyer = _Keyer(chunk, isolate_tenants)
    source = ""
    pending: list[tuple[int, str, dict[str, Any]]] = []  # text lines, tokenized in batches
    requests: list[Request] = []
    encode = _encoder(tokenizer) if tokenizer is not None else None
    stride = 1
    kept = 0

    def meta(obj: dict[str, Any], where: str, scale: float) -> dict[str, Any]:
        out = obj.get("output_length", obj.get("output_tokens"))
        if out is not None and (not isinstance(out, int) or isinstance(out, bool) or out < 0):
            raise LogError(f"{where}: 'output_length' must be a non-negative integer")
        return {"timestamp": _timestamp(obj.get("timestamp"), scale, where),
                "tenant": _label(obj, "tenant" if "tenant" in obj else "user", where),
                "model": _label(obj, "model", where), "output_tokens": out}

    def add_tokens(tokens: list[int], m: dict[str, Any]) -> None:
        nonlocal stride, kept
        keys = keyer.keys(tokens, m["model"], m["tenant"])
        i = len(requests)
        head = np.asarray(tokens[:head_tokens], dtype=np.uint32) if i % stride == 0 else None
        requests.append(Request(i, keys, len(tokens), chunk, head=head, **m))
        kept += head is not None
        if kept > 2 * max(1, keep_heads):  # thin the sample: keep every other kept head
            stride *= 2
            for j in range(0, len(requests), stride // 2):
                if j % stride:
                    requests[j] = replace(requests[j], head=None)
            kept = sum(1 for j in range(0, len(requests), stride))

    def flush() -> None:
        assert encode is not None
        for (_, _, m), ids in zip(pending, encode([t for _, t, _ in pending])):
            add_tokens(ids, m)
        pending.clear()

    chains = _Chains()  # Mooncake block ids
    for lineno, obj in json_lines(p, progress):
        where = f"{p}:{lineno}"
        if "hash_ids" in obj:
            kind = "mooncake"
        elif any(f in obj for f in TOKEN_FIELDS):
            kind = "tokens"
        elif any(f in obj for f in (*TEXT_FIELDS, "messages")):
            kind = "text"
        else:
            raise LogError(f"{where}: no prompt: expected one of {', '.join((*TOKEN_FIELDS, *TEXT_FIELDS, 'messages', 'hash_ids'))}")
        if source and kind != source:
            raise LogError(f"{where}: a {kind} line in a {source} log (formats may not be mixed)")
        source = kind
        if kind == "mooncake":
            m = meta(obj, where, 1e-3)
            ids = _int_list(obj["hash_ids"], "hash_ids", where, 64)
            n = obj.get("input_length", len(ids) * MOONCAKE_BLOCK_TOKENS)
            if not isinstance(n, int) or not (len(ids) - 1) * MOONCAKE_BLOCK_TOKENS < n <= len(ids) * MOONCAKE_BLOCK_TOKENS:
                raise LogError(f"{where}: 'input_length' {n!r} does not fit {len(ids)} blocks of {MOONCAKE_BLOCK_TOKENS} tokens")
            salt = keyer.namespace(m["model"], m["tenant"])[:8]
            keys = chains.keys([salt + h.to_bytes(8, "little") for h in ids], where)
            requests.append(Request(len(requests), keys, n if ids else 0, MOONCAKE_BLOCK_TOKENS, **m))
        elif kind == "tokens":
            field = next(f for f in TOKEN_FIELDS if f in obj)
            add_tokens(_int_list(obj[field], field, where, 32), meta(obj, where, 1.0))
        else:
            if tokenizer is None:
                raise LogError(f"{where}: a text prompt needs --tokenizer DIR (a local tokenizer directory)")
            field = next((f for f in TEXT_FIELDS if f in obj), "messages")
            text = obj[field] if field != "messages" else _messages_text(tokenizer, obj[field], where)
            if not isinstance(text, str):
                raise LogError(f"{where}: {field!r} must be a string")
            pending.append((lineno, text, meta(obj, where, 1.0)))
            if len(pending) >= 512:
                flush()
    if pending:
        flush()
    if not requests:
        raise LogError(f"log {str(p)!r}: no requests")
    chains.check(p)
    block = MOONCAKE_BLOCK_TOKENS if source == "mooncake" else chunk
    if chunk_tokens is not None and chunk_tokens != block:
        log.warning("%s: a Mooncake trace's chunks are its %d-token hash blocks; --chunk-tokens %d "
                    "is not used", p, block, chunk_tokens)
    ordered, late = time_order(requests)
    if late:
        log.warning("%s: %d of %d requests are earlier than a request before them in the file; "
                    "replaying in timestamp order", p, late, len(requests))
    return Log(str(p), source, tuple(ordered), block, out_of_order=late)
