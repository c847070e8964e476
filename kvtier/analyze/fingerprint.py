"""``kvtier analyze --fingerprint TEMPLATE``: a golden-value check on a prompt's stable prefix.

The *stable prefix* of a prompt template is its text up to the first placeholder
(``{{ … }}``, ``{% … %}``, ``${…}`` or ``{name}``): what every request starts with, and so what
a prefix cache reuses. Teams keep its hash as a golden value in the repository; CI fails when
it changes unintentionally (an edit, a reordered tool, a timestamp that crept in), with the
place it diverged. With a tokenizer the token ids are hashed too, so a tokenizer or chat-template
upgrade that re-tokenizes the same text is caught as well.

The golden file (default ``TEMPLATE.fingerprint.json``, written by ``--update``) holds the
hashes and the stable prefix itself, so that a failure can show a diff. Pure functions plus
:func:`load_golden` / :func:`write_golden`; the command turns a result into an exit status.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PLACEHOLDER = re.compile(r"\{\{|\{%|\$\{|\{[A-Za-z_][A-Za-z0-9_.]*\}")
VOLATILE = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}|\b\d{1,2}:\d{2}:\d{2}\b|"
                      r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
SCHEMA = "kvtier.fingerprint/v1"
Encode = Callable[[str], list[int]]


class FingerprintError(ValueError):
    """The template or golden file cannot be read."""


@dataclass(frozen=True)
class Fingerprint:
    stable_prefix: str
    sha256: str
    placeholder: str  # the placeholder that ends the stable prefix ("" if none)
    tokens: int | None = None
    token_sha256: str | None = None

    def to_json(self, template: str) -> dict[str, Any]:
        return {"schema": SCHEMA, "template": template, "sha256": self.sha256,
                "stable_chars": len(self.stable_prefix), "stable_tokens": self.tokens,
                "token_sha256": self.token_sha256, "ends_at_placeholder": self.placeholder,
                "stable_prefix": self.stable_prefix}


def fingerprint(text: str, encode: Encode | None = None) -> Fingerprint:
    m = PLACEHOLDER.search(text)
    stable = text[: m.start()] if m else text
    placeholder = m.group(0) if m else ""
    ids = encode(stable) if encode else None
    tok_hash = hashlib.sha256(json.dumps(ids).encode()).hexdigest() if ids is not None else None
    return Fingerprint(stable, hashlib.sha256(stable.encode()).hexdigest(), placeholder,
                       len(ids) if ids is not None else None, tok_hash)


def golden_path(template: Path, golden: Path | None) -> Path:
    return golden if golden is not None else template.with_name(template.name + ".fingerprint.json")


def load_golden(path: Path) -> dict[str, Any] | None:
    """The golden document, None if the file does not exist."""
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FingerprintError(f"golden file {str(path)!r}: cannot read it: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("stable_prefix"), str):
        raise FingerprintError(f"golden file {str(path)!r}: not a {SCHEMA} document")
    return doc


def write_golden(path: Path, fp: Fingerprint, template: str) -> None:
    path.write_text(json.dumps(fp.to_json(template), indent=2) + "\n")


def _where(text: str, offset: int) -> tuple[int, int, str]:
    line = text.count("\n", 0, offset) + 1
    start = text.rfind("\n", 0, offset) + 1
    end = text.find("\n", offset)
    return line, offset - start + 1, text[start: end if end >= 0 else len(text)]


def diff(golden: str, current: str, context: int = 3) -> str:
    """Where ``current`` first departs from ``golden`` (line, column, a caret) and a short diff."""
    n = next((i for i, (a, b) in enumerate(zip(golden, current)) if a != b), min(len(golden), len(current)))
    line, col, gl = _where(golden, n)
    _, _, cl = _where(current, n)
    out = [f"first difference at line {line}, column {col} (character {n}):",
           f"  golden : {gl}", f"  current: {cl}", "           " + " " * (col - 1) + "^"]
    if len(current) < len(golden) and n == len(current):
        out.append(f"  the stable prefix is now {len(golden) - len(current)} characters shorter "
                   "(a placeholder moved earlier?)")
    lines = list(difflib.unified_diff(golden.splitlines(), current.splitlines(), "golden", "current",
                                      n=context, lineterm=""))
    if lines:
        out += ["", *lines[:40], *(["  …"] if len(lines) > 40 else [])]
    return "\n".join(out)


def check(fp: Fingerprint, golden: dict[str, Any]) -> list[str]:
    """Problems of ``fp`` against ``golden`` (empty: unchanged)."""
    problems = []
    if fp.sha256 != golden.get("sha256"):
        problems.append(f"stable prefix changed: sha256 {fp.sha256[:16]}… (golden {str(golden.get('sha256'))[:16]}…)\n"
                        + diff(golden["stable_prefix"], fp.stable_prefix))
    elif fp.token_sha256 is not None and golden.get("token_sha256") not in (None, fp.token_sha256):
        problems.append(f"same text, different tokens: {fp.tokens} tokens now, {golden.get('stable_tokens')} "
                        "in the golden file (a tokenizer or chat-template change re-tokenizes the prefix: "
                        "every cached prefix misses)")
    return problems


def warnings(fp: Fingerprint) -> list[str]:
    """Volatile-looking text inside the stable prefix (it would break the cache per request)."""
    out = []
    for m in VOLATILE.finditer(fp.stable_prefix):
        line, col, text = _where(fp.stable_prefix, m.start())
        out.append(f"line {line}, column {col}: {m.group(0)!r} looks like a timestamp or id inside "
                   f"the stable prefix: {text.strip()[:100]}")
    return out
