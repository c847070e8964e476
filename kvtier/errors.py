"""kvtier's error types: one per kind of failure a caller may want to tell apart."""

from __future__ import annotations


class KVTierError(Exception):
    """Base of every error kvtier raises on purpose."""


class ChunkError(KVTierError, ValueError):
    """A chunk's bytes cannot be trusted; ``reason`` is a miss-reason label.

    Reasons: truncated, bad_magic, bad_version, corrupt, unknown_codec, unknown_dtype,
    namespace_mismatch, key_mismatch, layout_mismatch.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class ConfigError(KVTierError, ValueError):
    """An invalid configuration value; the message names the field and what is allowed."""


class TierUnavailableError(KVTierError):
    """A tier cannot be opened at all (unwritable directory, bad credentials, ...)."""


def not_utf8(exc: UnicodeDecodeError, unit: str = "offset") -> str:
    """The tail of an error message for text that is not UTF-8: which byte, and where
    (``unit`` "offset": 0-based in the file; "column": 1-based in a line)."""
    at = exc.start + 1 if unit == "column" else exc.start
    return f"not UTF-8 text (byte {exc.object[exc.start]:#04x} at {unit} {at})"
