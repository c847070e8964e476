"""Self-describing chunk format: a 128-byte header followed by the (encoded) payload.

Any index can be rebuilt from the data alone, and a reader can always tell whether the bytes
in front of it are the chunk it asked for. Header layout (little-endian, 128 bytes)::

    off size field
      0   4  magic            b"KVTC"
      4   2  format version   1
      6   1  codec            0 raw, 1 lz4, 2 zstd
      7   1  flags            bit 0: payload byte-shuffled before compression
      8   1  dtype code       see DTYPES
      9   1  kv               2 (K and V) or 1 (latent / MLA)
     10   2  reserved         0
     12   4  reserved         0
     16  16  layers, tokens, heads, head_dim   (uint32 each)
     32  32  namespace id
     64  32  chunk key
     96   8  raw payload length (decoded bytes)
    104   8  stored payload length (bytes after the header)
    112   8  payload checksum  xxh3-64 of the stored payload
    120   8  header checksum   xxh3-64 of bytes 0..119

Decoding never returns bytes it could not verify: every problem raises :class:`ChunkError`
whose ``reason`` is the miss-reason label the store counts.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvtier.codec import Buf, Codec, compress, decompress
from kvtier.errors import ChunkError
from kvtier.keys import KEY_BYTES

MAGIC = b"KVTC"
VERSION = 1
_HEAD = struct.Struct("<4sHBBBBHI4I32s32sQQQ")
_CHECK = struct.Struct("<Q")
_HEADER = struct.Struct(_HEAD.format + "Q")  # the fields and the header checksum after them
HEADER_SIZE = _HEAD.size + _CHECK.size
assert HEADER_SIZE == 128
FLAG_SHUFFLE = 1
PAGE = 4096

# dtype name -> (code, itemsize). Codes are part of the on-disk format: never renumber.
DTYPES: dict[str, tuple[int, int]] = {
    "float16": (1, 2),
    "bfloat16": (2, 2),
    "float32": (3, 4),
    "float8_e4m3fn": (4, 1),
    "float8_e5m2": (5, 1),
    "uint8": (6, 1),
    "int8": (7, 1),
}
_DTYPE_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}
_CODEC_BY_ID = {int(c): c for c in Codec}

Shape = tuple[int, int, int, int, int]  # (layers, kv, tokens, heads, head_dim)


def dtype_itemsize(dtype: str) -> int:
    try:
        return DTYPES[dtype][1]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype!r}; expected one of {sorted(DTYPES)}") from None


@dataclass(frozen=True)
class ChunkHeader:
    codec: Codec
    shuffled: bool
    dtype: str
    shape: Shape
    namespace: bytes
    key: bytes
    raw_len: int
    payload_len: int
    checksum: int

    @property
    def nbytes(self) -> int:
        """Total encoded size: header plus stored payload."""
        return HEADER_SIZE + self.payload_len

    @property
    def tokens(self) -> int:
        return self.shape[2]


@dataclass(frozen=True)
class Chunk:
    """A decoded chunk. ``payload`` holds raw K/V bytes in ``header.shape`` order.

    ``payload`` may be a view into the buffer given to :func:`decode_chunk` (raw codec):
    the caller owns that buffer and must keep it alive and unchanged while using the view.
    """

    header: ChunkHeader
    payload: Buf


def page_aligned_buffer(nbytes: int) -> memoryview:
    """A writable ``nbytes`` buffer starting on a page boundary (pages are touched on write)."""
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    off = -raw.ctypes.data % PAGE
    return memoryview(raw[off : off + nbytes].data)


def encode_chunk(
    namespace: bytes,
    key: bytes,
    dtype: str,
    shape: Shape,
    payload: Buf,
    *,
    codec: Codec | str = Codec.RAW,
    shuffle: bool = False,
) -> memoryview:
    """Header + encoded payload in one fresh, writable, page-aligned buffer (one copy of
    ``payload`` for raw). Page alignment lets the disk tier write it with O_DIRECT in place.
    A payload the codec does not shrink is stored raw (the header says so): a chunk is never
    larger than its raw form."""
    codec = Codec.parse(codec)
    if len(namespace) != KEY_BYTES or len(key) != KEY_BYTES:
        raise ValueError(f"namespace and key must be {KEY_BYTES} bytes each")
    if len(shape) != 5 or any(int(d) < 0 or int(d) > 0xFFFFFFFF for d in shape):
        raise ValueError(f"shape must be 5 dims (layers, kv, tokens, heads, head_dim), got {shape}")
    code, itemsize = DTYPES.get(dtype, (0, 0))
    if not code:
        raise ValueError(f"unsupported KV dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    view = memoryview(payload).cast("B")
    expect = math.prod(shape) * itemsize
    if view.nbytes != expect:
        raise ChunkError("layout_mismatch", f"payload has {view.nbytes} bytes, shape {shape} of {dtype} needs {expect}")
    stored = compress(codec, view, shuffle_itemsize=itemsize if shuffle else 0)
    stored_len = memoryview(stored).nbytes
    if codec is not Codec.RAW and stored_len >= expect:
        # Incompressible (fp8 K/V often is): lz4 and zstd would store a few KiB *more* than
        # the payload, and a chunk sized for raw pages (a RAM slot) would no longer fit.
        codec, shuffle, stored, stored_len = Codec.RAW, False, view, expect
    out = page_aligned_buffer(HEADER_SIZE + stored_len)
    out[HEADER_SIZE:] = stored
    _write_header(out, namespace, key, code, shape, codec, shuffle, expect, stored_len)
    return out


def frame_raw_chunk(out: memoryview, namespace: bytes, key: bytes, dtype: str, shape: Shape, *,
                    payload_xxh3: int | None = None) -> memoryview:
    """Frame a raw-codec chunk in place: ``out[HEADER_SIZE:]`` already holds the payload
    (``shape`` of ``dtype``, C order); the header is written in front of it. Returns the chunk,
    ``out`` trimmed to header + payload. For callers that copy K/V straight from an engine's
    buffer into a reusable (page-aligned) chunk buffer: no payload copy here, no allocation.
    ``payload_xxh3``: the payload's xxh3_64 where the caller took it while copying the payload
    in (:func:`kvtier.strided.gather_into`); it must be of exactly those bytes (a wrong one
    makes every read refuse the chunk). Left out, it is computed here."""
    code, itemsize = DTYPES.get(dtype, (0, 0))
    if not code:
        raise ValueError(f"unsupported KV dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    if len(namespace) != KEY_BYTES or len(key) != KEY_BYTES:
        raise ValueError(f"namespace and key must be {KEY_BYTES} bytes each")
    raw = math.prod(shape) * itemsize
    if out.nbytes < HEADER_SIZE + raw:
        raise ValueError(f"chunk buffer of {out.nbytes} bytes cannot hold {HEADER_SIZE + raw}")
    chunk = out[: HEADER_SIZE + raw]
    _write_header(chunk, namespace, key, code, shape, Codec.RAW, False, raw, raw, payload_xxh3)
    return chunk


def _write_header(out: memoryview, namespace: bytes, key: bytes, code: int, shape: Shape,
                  codec: Codec, shuffle: bool, raw_len: int, stored_len: int,
                  payload_xxh3: int | None = None) -> None:
    """Write the header of the chunk whose stored payload is ``out[HEADER_SIZE:]`` (its xxh3
    computed here unless given)."""
    if payload_xxh3 is None:
        payload_xxh3 = xxhash.xxh3_64_intdigest(out[HEADER_SIZE : HEADER_SIZE + stored_len])
    layers, kv, tokens, heads, head_dim = (int(d) for d in shape)
    head = _HEAD.pack(
        MAGIC, VERSION, int(codec), FLAG_SHUFFLE if shuffle else 0, code, kv, 0, 0,
        layers, tokens, heads, head_dim, namespace, key, raw_len, stored_len, payload_xxh3,
    )
    out[: _HEAD.size] = head
    out[_HEAD.size : HEADER_SIZE] = _CHECK.pack(xxhash.xxh3_64_intdigest(head))


def _checked_fields(data: Buf) -> tuple[memoryview, tuple[Any, ...]]:
    """The header's fields, unpacked, once every check on them has passed (magic, header
    checksum, version, codec, dtype, layout); a :class:`ChunkError` naming the first that
    fails. Shared by :func:`decode_header` and :func:`header_names`: one list of checks."""
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    if view.nbytes < HEADER_SIZE:
        raise ChunkError("truncated", f"{view.nbytes} bytes is shorter than the {HEADER_SIZE}-byte header")
    # Every field at once (unpack_from: no slice objects), checked in the order below.
    fields = _HEADER.unpack_from(view)
    (magic, version, codec_id, _, dcode, kv, _, _, layers, tokens, heads, head_dim,
     _, _, raw_len, _, _, check) = fields
    if magic != MAGIC:
        raise ChunkError("bad_magic", f"magic {magic!r} is not {MAGIC!r}")
    if xxhash.xxh3_64_intdigest(view[: _HEAD.size]) != check:
        raise ChunkError("corrupt", "header checksum mismatch")
    if version != VERSION:
        raise ChunkError("bad_version", f"format version {version}, this reader knows {VERSION}")
    if codec_id not in _CODEC_BY_ID:
        raise ChunkError("unknown_codec", f"codec id {codec_id}")
    dtype = _DTYPE_BY_CODE.get(dcode)
    if dtype is None:
        raise ChunkError("unknown_dtype", f"dtype code {dcode}")
    if raw_len != layers * kv * tokens * heads * head_dim * DTYPES[dtype][1]:
        shape = (layers, kv, tokens, heads, head_dim)
        raise ChunkError("layout_mismatch", f"raw length {raw_len} does not match shape {shape} of {dtype}")
    return view, fields


def decode_header(data: Buf) -> ChunkHeader:
    """Parse and verify the 128-byte header (not the payload)."""
    _, (_, _, codec_id, flags, dcode, kv, _, _, layers, tokens, heads, head_dim,
        namespace, key, raw_len, payload_len, checksum, _) = _checked_fields(data)
    return ChunkHeader(_CODEC_BY_ID[codec_id], bool(flags & FLAG_SHUFFLE), _DTYPE_BY_CODE[dcode],
                       (layers, kv, tokens, heads, head_dim), namespace, key, raw_len, payload_len, checksum)


def header_names(data: Buf, key: bytes) -> bool:
    """Whether ``data`` is exactly one chunk of ``key`` by its header: every check
    :func:`decode_header` makes, plus the key and a total length equal to ``len(data)``. Not
    the payload checksum (left to the reader that decodes). The guard a client puts on each
    chunk a node returns, about a microsecond: no :class:`ChunkHeader` is built."""
    try:
        view, fields = _checked_fields(data)
    except ChunkError:
        return False
    return bool(fields[13] == key and HEADER_SIZE + fields[15] == view.nbytes)


def payload_checksum(data: Buf) -> int:
    """The payload checksum a chunk's header records (no check made: call it on a header
    :func:`header_names` or :func:`decode_header` has accepted)."""
    return int(_CHECK.unpack_from(data, _HEAD.size - _CHECK.size)[0])


def decode_chunk(
    data: Buf,
    *,
    namespace: bytes | None = None,
    key: bytes | None = None,
    dtype: str | None = None,
    shape: Shape | None = None,
    verify: bool = True,
) -> Chunk:
    """Verify and decode a chunk; each ``expect`` argument that is given must match.

    ``verify=False`` skips only the payload checksum (for bytes that never left this process).
    Trailing bytes after the payload (alignment padding) are ignored.
    """
    header = decode_header(data)
    view = memoryview(data).cast("B")
    if view.nbytes < header.nbytes:
        raise ChunkError("truncated", f"{view.nbytes} bytes, header says {header.nbytes}")
    if namespace is not None and header.namespace != namespace:
        raise ChunkError("namespace_mismatch", "chunk belongs to another namespace")
    if key is not None and header.key != key:
        raise ChunkError("key_mismatch", "chunk carries another key than the one asked for")
    if dtype is not None and header.dtype != dtype:
        raise ChunkError("layout_mismatch", f"chunk dtype {header.dtype}, expected {dtype}")
    if shape is not None and header.shape != tuple(shape):
        raise ChunkError("layout_mismatch", f"chunk shape {header.shape}, expected {tuple(shape)}")
    stored = view[HEADER_SIZE : header.nbytes]
    if verify and xxhash.xxh3_64_intdigest(stored) != header.checksum:
        raise ChunkError("corrupt", "payload checksum mismatch")
    itemsize = DTYPES[header.dtype][1] if header.shuffled else 0
    payload = decompress(header.codec, stored, header.raw_len, shuffle_itemsize=itemsize)
    return Chunk(header, payload)
