"""What the sans-I/O protocol tests share: their wire limits, and bytes from encoder parts and
frames from bytes without a socket."""

from __future__ import annotations

from kvtier.protocol.frames import Frame, FrameReader, WireLimits

LIMITS = WireLimits(max_chunk_bytes=1 << 16, max_batch_keys=64)


def join(parts: list) -> bytes:
    return b"".join(bytes(p) for p in parts)


def frames(data: bytes) -> list[Frame]:
    return FrameReader(LIMITS).feed(data)
