"""A Get stream's reply messages, encoded straight to protobuf wire bytes.

Why by hand: through the protobuf classes every chunk is copied twice (into the message,
then into its serialization), on the thread that builds the message. The servicer builds
replies on an executor thread, so that the event loop, which every tenant's gRPC calls share,
only hands finished bytes to grpc; and one ``bytes.join`` is the only copy. The output is the
canonical encoding of ``kvtier.v1.GetReply`` (fields in number order, proto3 defaults left
out), which ``tests/test_get_replies.py`` checks against the protobuf classes.

No I/O and no locks: pure functions of their arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.tiers.base import ERROR, Miss

_ITEMS = 0x0A  # GetReply.items: field 1, length-delimited
_INDEX = 0x08  # GetItem.index: field 1, varint
_CHUNK = 0x12  # GetItem.chunk: field 2, length-delimited
_REASON = 0x1A  # GetItem.miss_reason: field 3, length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _item_head(index: int, field: int, length: int) -> bytes:
    """The bytes of one GetItem (in its GetReply) up to its last field's ``length`` bytes."""
    body = ((bytes((_INDEX,)) + _varint(index) if index else b"")
            + (bytes((field,)) + _varint(length) if length else b""))
    return bytes((_ITEMS,)) + _varint(len(body) + length) + body


def encode_get_replies(values: Sequence[bytes | Miss], first: int, budget: int) -> list[bytes]:
    """Serialized GetReply messages for ``values`` (the chunks or misses of the keys at
    ``first``, ``first + 1``, ...), in order. A message holds chunks up to ``budget`` bytes;
    a chunk bigger than ``budget`` goes alone. A miss with an empty reason is sent as
    ``ERROR`` (an empty reason would read as an empty chunk)."""
    messages: list[bytes] = []
    parts: list[bytes] = []
    size = 0
    for index, value in enumerate(values, first):
        if isinstance(value, Miss):
            reason = (value.reason or ERROR).encode()
            parts += (_item_head(index, _REASON, len(reason)), reason)
            continue
        if parts and size + len(value) > budget:
            messages.append(b"".join(parts))
            parts, size = [], 0
        parts += (_item_head(index, _CHUNK, len(value)), value)
        size += len(value)
    if parts:
        messages.append(b"".join(parts))
    return messages
