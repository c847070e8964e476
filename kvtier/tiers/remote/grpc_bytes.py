"""Chunk bytes over gRPC, the portable fallback of the data path: messages out, replies in.

Pure helpers of :class:`kvtier.tiers.remote.node.NodeClient`: they build the Put stream's
messages and check a Get stream's replies, raising :class:`NodeError` (``down``) for a reply a
correct server never sends. The RPC itself, its deadline and its error mapping stay with the
node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from kvtier.protocol.gen import kvtier_pb2 as pb
from kvtier.tiers.base import ERROR, Entry, Miss
from kvtier.tiers.remote.errors import NodeError, check_chunk

PUT_MESSAGE_BYTES = 8 << 20  # chunks per PutRequest message, by bytes (bigger: more latency)


def put_messages(entries: Sequence[Entry]) -> Iterator[pb.PutRequest]:
    """The Put stream for ``entries``: messages of up to :data:`PUT_MESSAGE_BYTES` of chunks
    (one chunk per message when a chunk is bigger), in order."""
    msg, size = pb.PutRequest(), 0
    for e in entries:
        if msg.items and size + len(e.data) > PUT_MESSAGE_BYTES:
            yield msg
            msg, size = pb.PutRequest(), 0
        msg.items.add(key=e.key, chunk=bytes(e.data), depth=e.depth, parent=e.parent)
        size += len(e.data)
    if msg.items:
        yield msg


def get_results(address: str, keys: Sequence[bytes], replies: Iterable[pb.GetReply]) -> list[bytes | Miss]:
    """Each key's chunk (checked against its key) or Miss, from the Get stream's ``replies``;
    a key no reply names is an ERROR miss. Iterating ``replies`` may raise grpc.RpcError."""
    out: list[bytes | Miss] = [Miss(ERROR)] * len(keys)
    for reply in replies:
        for item in reply.items:
            if item.index >= len(keys):
                raise NodeError(ERROR, f"{address}: Get reply index {item.index} out of range", down=True)
            out[item.index] = (Miss(item.miss_reason or ERROR) if item.miss_reason
                               else check_chunk(keys[item.index], item.chunk))
    return out


def visit_all(values: Sequence[bytes | Miss], visit: Callable[[int, memoryview], None]) -> list[int | Miss]:
    """``get_visit``'s contract over chunks already in memory: ``visit(i, view)`` for each
    found, then each one's length or its Miss."""
    for i, value in enumerate(values):
        if not isinstance(value, Miss):
            visit(i, memoryview(value))
    return [v if isinstance(v, Miss) else len(v) for v in values]
