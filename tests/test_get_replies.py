"""The hand-encoded Get replies (kvtier.server.get_replies) against the protobuf classes:
byte-identical to ``GetReply.SerializeToString`` for the same items, split by the same budget
rule the servicer used before, and parsed back to the same chunks and misses."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.protocol.gen import kvtier_pb2 as pb
from kvtier.server.get_replies import encode_get_replies
from kvtier.tiers.base import ERROR, Miss

values = st.lists(st.one_of(st.binary(max_size=300), st.sampled_from(["absent", "expired", ""]).map(Miss)),
                  max_size=12)


def protobuf_replies(items: list[bytes | Miss], first: int, budget: int) -> list[bytes]:
    """The servicer's old loop, through the protobuf classes."""
    out, reply, size = [], pb.GetReply(), 0
    for i, value in enumerate(items, first):
        if isinstance(value, Miss):
            reply.items.add(index=i, miss_reason=value.reason or ERROR)
            continue
        if size + len(value) > budget and reply.items:
            out.append(reply.SerializeToString())
            reply, size = pb.GetReply(), 0
        reply.items.add(index=i, chunk=value)
        size += len(value)
    if reply.items:
        out.append(reply.SerializeToString())
    return out


@settings(max_examples=400, deadline=None)
@given(values, st.sampled_from([0, 1, 127, 128, 16383, 16384, 2**32 - 20]), st.integers(1, 700))
def test_same_bytes_as_protobuf(items: list[bytes | Miss], first: int, budget: int) -> None:
    assert encode_get_replies(items, first, budget) == protobuf_replies(items, first, budget)


def test_large_chunks_parse_back() -> None:
    """Lengths past one varint byte (and past 2 MiB), a miss between chunks, a chunk over the
    budget alone in its message."""
    big = bytes(range(256)) * (9 << 10)  # 2.25 MiB
    items: list[bytes | Miss] = [b"a" * 200, Miss("absent"), big, b"", b"z" * 70000]
    messages = encode_get_replies(items, 5, 1 << 20)
    assert len(messages) == 3  # [a, miss], [big], ["", z]
    got: dict[int, bytes | str] = {}
    for raw in messages:
        for item in pb.GetReply.FromString(raw).items:
            got[item.index] = item.miss_reason or item.chunk
    assert got == {5: b"a" * 200, 6: "absent", 7: big, 8: b"", 9: b"z" * 70000}
