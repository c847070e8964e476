"""Payload codecs (sans-I/O): raw, lz4, zstd, each with an optional byte-shuffle.

Byte-shuffle splits fp16/bf16 elements into byte planes (all high bytes, then all low bytes)
so that the compressible exponent bytes sit together; on fp16/bf16 KV, lz4 alone barely
compresses (~1.02x), so shuffling first is what makes compression worth measuring.

All functions are pure: bytes in, bytes out, no I/O, thread-safe.
"""

from __future__ import annotations

import enum

import numpy as np

from kvtier.errors import ChunkError

Buf = bytes | bytearray | memoryview


class Codec(enum.IntEnum):
    RAW = 0
    LZ4 = 1
    ZSTD = 2

    @classmethod
    def parse(cls, name: str | int | Codec) -> Codec:
        if isinstance(name, Codec):
            return name
        if isinstance(name, int):
            return cls(name)
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown codec {name!r}; expected one of raw, lz4, zstd") from None


def shuffle(data: Buf, itemsize: int) -> bytes:
    """Byte planes of ``data`` viewed as ``itemsize``-byte elements."""
    if itemsize <= 1:
        return bytes(data)
    arr = np.frombuffer(data, dtype=np.uint8).reshape(-1, itemsize)
    return arr.T.tobytes()


def unshuffle(data: Buf, itemsize: int) -> bytes:
    if itemsize <= 1:
        return bytes(data)
    arr = np.frombuffer(data, dtype=np.uint8).reshape(itemsize, -1)
    return arr.T.tobytes()


def compress(codec: Codec, data: Buf, *, shuffle_itemsize: int = 0, level: int = 1) -> Buf:
    """Encode ``data``; RAW without shuffle returns ``data`` itself (no copy)."""
    if shuffle_itemsize > 1:
        if len(data) % shuffle_itemsize:
            raise ValueError(f"shuffle needs a length multiple of {shuffle_itemsize}, got {len(data)}")
        data = shuffle(data, shuffle_itemsize)
    if codec == Codec.RAW:
        return data
    if codec == Codec.LZ4:
        import lz4.block

        return lz4.block.compress(data, store_size=False)
    if codec == Codec.ZSTD:
        import zstandard

        return zstandard.ZstdCompressor(level=level).compress(data)
    raise ValueError(f"unknown codec {codec!r}")


def decompress(codec: Codec, data: Buf, raw_len: int, *, shuffle_itemsize: int = 0) -> Buf:
    """Inverse of :func:`compress`; raises ChunkError('corrupt') on malformed input. Never
    allocates more than ``raw_len`` bytes of output (the chunk header's declared length),
    whatever sizes the compressed stream itself claims."""
    out: Buf
    try:
        if codec == Codec.RAW:
            out = data
        elif codec == Codec.LZ4:
            import lz4.block

            out = lz4.block.decompress(data, uncompressed_size=raw_len)
        elif codec == Codec.ZSTD:
            import zstandard

            # max_output_size bounds only a frame that does not declare its size: one that
            # does is decompressed into a buffer of the size it declares, whatever raw_len
            # says (a 2 KiB frame filled 64 MiB before the length check below refused it).
            declared = zstandard.get_frame_parameters(data).content_size
            if declared not in (raw_len, zstandard.CONTENTSIZE_UNKNOWN):
                raise ChunkError("corrupt", f"ZSTD frame declares {declared} bytes, header says {raw_len}")
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_len)
        else:
            raise ChunkError("unknown_codec", f"codec id {int(codec)} is not known")
    except ChunkError:
        raise
    except Exception as exc:  # noqa: BLE001 - every codec library has its own error types
        raise ChunkError("corrupt", f"{codec.name} payload does not decode: {exc}") from exc
    if len(out) != raw_len:
        raise ChunkError("corrupt", f"{codec.name} payload decodes to {len(out)} bytes, header says {raw_len}")
    if shuffle_itemsize > 1:
        out = unshuffle(out, shuffle_itemsize)
    return out
