"""Where kvtier.config's values come from, before they are typed: byte sizes, ``KVTIER_*``
environment names, YAML files, and merging them. Split from kvtier.config to keep each file
readable; kvtier.config re-exports every public name here."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, not_utf8

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?[bB]?|[bB])?\s*$")
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "ki": 1 << 10, "m": 10**6,
          "mb": 10**6, "mib": 1 << 20, "mi": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30,
          "gi": 1 << 30, "t": 10**12, "tb": 10**12, "tib": 1 << 40, "ti": 1 << 40}
MAX_SIZE = (1 << 63) - 1  # what an off_t / ssize_t holds


def parse_size(value: Any, where: str = "size") -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a byte size, got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ConfigError(f"{where}: {value!r} is not a byte size (e.g. 1048576, 512MiB, 4GiB)")
        # Fraction, not float: exact, and a many-digit size does not overflow to infinity.
        size = int(Fraction(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if size > MAX_SIZE:
        raise ConfigError(f"{where}: {str(value)[:40]!r} is too large (at most {MAX_SIZE} bytes)")
    return size


def env_to_dict(env: Mapping[str, str], prefix: str = "KVTIER_") -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Sorted, so that a section set as a plain value (KVTIER_CPU) is met before its fields.
    for name in sorted(n for n in env if n.startswith(prefix)):
        path = name[len(prefix):].lower().split("__")
        node = out
        for depth, part in enumerate(path[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                scalar = prefix + "__".join(path[:depth + 1]).upper()
                raise ConfigError(f"{name}: {scalar} is also set, as a plain value, but {part!r} is "
                                  f"a section: set its fields as {scalar}__<FIELD> only")
        node[path[-1]] = env[name]
    return out


def env_suggestion(cls: type, rest: str) -> str | None:
    """The ``KVTIER_*`` setting that ``KVTIER_<rest>`` (``rest`` lower-case, an unknown name)
    most likely meant, or None: a section joined to its field by one underscore
    (KVTIER_DISK_PATH) or a near spelling (KVTIER_CHUNK_TOKEN)."""
    if rest.startswith("server_"):
        return None  # kvtier-server's namespace, never a misspelt library setting
    spellings: list[str] = []
    for f in dataclasses.fields(cls):
        if not dataclasses.is_dataclass(f.default):
            spellings.append(f.name)
            continue
        if rest.startswith(f.name + "_"):
            return f"KVTIER_{f.name}__{rest[len(f.name) + 1:]}".upper()
        spellings += [f"{f.name}__{g.name}" for g in dataclasses.fields(f.default)]
    close = difflib.get_close_matches(rest, spellings, n=1, cutoff=0.8)
    return f"KVTIER_{close[0]}".upper() if close else None


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path}: {not_utf8(exc)}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {exc}") from exc
    except RecursionError:
        raise ConfigError(f"config file {path}: not valid YAML: nested deeper than the parser goes") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    return data


def deep_merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            deep_merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value
