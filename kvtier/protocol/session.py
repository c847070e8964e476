"""kvtier.protocol.frames's conversation rules, sans-I/O: which frame may come when, on each side.

:class:`ServerSession` checks the order of what a client sends (HELLO first, then GETs, LOOKUPs,
PUT batches and the shared-memory handshake) and decodes each frame into a request;
:class:`GetReplyCollector` checks the frames answering one GET. Both raise
:class:`~kvtier.protocol.frames.ProtocolError` for anything out of place; the connection is then unusable.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.protocol.frames import (
    ARENA,
    CHUNK,
    ERROR,
    GET,
    LOOKUP,
    MISS,
    PUT,
    SHM,
    SHM_MAPPED,
    SHM_OPEN,
    TYPE_NAMES,
    Frame,
    LookupKeys,
    ProtocolError,
    PutItem,
    ShmRef,
    WireLimits,
    expect_type,
    parse_get,
    parse_hello,
    parse_lookup,
    parse_put,
    parse_ref,
    parse_text,
    split_put,
)


@dataclass(frozen=True)
class ShmControl:
    """SHM_OPEN (``ok`` unused) or SHM_MAPPED (``ok``: what the client mapped, the
    ``MAPPED_*`` bits; 0: nothing)."""

    type: int
    ok: int


class ServerSession:
    """Frame order on the server side: HELLO first, then GETs, LOOKUPs and PUT batches (none
    inside a batch). ``accept`` returns the frame's request or raises ProtocolError for a frame
    out of place."""

    def __init__(self, limits: WireLimits) -> None:
        self.limits = limits
        self.authenticated = False
        self.in_put = 0  # items received in the current PUT batch

    def accept(self, frame: Frame) -> str | list[bytes] | LookupKeys | PutItem | ShmControl:
        if not self.authenticated:
            token = parse_hello(frame)
            self.authenticated = True
            return token
        if frame.type == GET and not self.in_put:
            return parse_get(frame, self.limits)
        if frame.type == LOOKUP and not self.in_put:
            return parse_lookup(frame, self.limits)
        if frame.type in (SHM_OPEN, SHM_MAPPED) and not self.in_put:
            return ShmControl(frame.type, frame.header.count)
        if frame.type == PUT:
            return self._in_batch(parse_put(frame))
        raise ProtocolError(f"unexpected {TYPE_NAMES[frame.type]} frame from a client")

    def accept_split_put(self, flags: int, count: int, keys: memoryview, chunk: memoryview) -> PutItem:
        """A PUT frame its receiver split itself, the keys in ``keys`` and the chunk in
        ``chunk`` (kvtier.server.put_run): what :meth:`accept` does with that frame, without
        building it."""
        if not self.authenticated:
            raise ProtocolError("PUT before HELLO")
        return self._in_batch(split_put(flags, count, keys, chunk))

    def _in_batch(self, item: PutItem) -> PutItem:
        self.in_put = self.in_put + 1 if item.more else 0
        if self.in_put > self.limits.max_batch_keys:
            raise ProtocolError(f"PUT batch longer than max_batch_keys={self.limits.max_batch_keys}")
        return item


class GetReplyCollector:
    """Client side of one GET: consumes CHUNK/MISS frames (or one ERROR) until every index
    has answered. ``results[i]`` is the chunk as ``bytes`` (or, with ``into=True``, its length:
    the body went to a target buffer), a :class:`ShmRef` into the shared segment, or the miss
    reason as ``str``."""

    def __init__(self, n: int, into: bool = False) -> None:
        self.n = n
        self.into = into
        self.results: list[bytes | int | str | ShmRef] = []
        self.error: tuple[int, str] | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or len(self.results) == self.n

    def accept(self, frame: Frame) -> None:
        if frame.type == ERROR and not self.results:
            self.error = (frame.header.count, parse_text(frame))
            return
        expect_type(frame, CHUNK, MISS)
        if frame.header.count != len(self.results):
            raise ProtocolError(f"reply for index {frame.header.count}, expected {len(self.results)}")
        if frame.type == MISS:
            self.results.append(parse_text(frame))
        elif frame.header.flags & SHM:
            self.results.append(parse_ref(frame.body, "CHUNK", bool(frame.header.flags & ARENA)))
        elif frame.header.flags & ARENA:
            raise ProtocolError("CHUNK with the ARENA flag but not SHM")
        else:
            self.results.append(frame.body.nbytes if self.into else frame.body_bytes())
