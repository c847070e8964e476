"""How a data-path verb cuts its keys into requests: at most ``max_batch_keys`` each, and on
shared memory no more bytes than the connection's segment holds.

Why: the server places a GET's chunks in the segment one after another from its start, and
the client a PUT's; what does not fit travels inline over the socket (and a PUT's chunk is
first framed into fresh memory). A request of 64 chunks of 4 MiB through a 32 MiB segment
sent 7/8 of its bytes that way. Several requests that each fit cost a round trip apiece (the
segment is reused once a request's reply is in) and keep every chunk on the shared path.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvtier.protocol.wire import placed_bytes


def request_spans(sizes: Sequence[int], most: int, room: int) -> list[tuple[int, int]]:
    """``[start, end)`` spans covering ``sizes`` in order, each of at most ``most`` items whose
    placed sizes add up to at most ``room`` (``room`` <= 0: no byte bound). An item larger than
    ``room`` gets a span of its own (it goes inline, alone)."""
    if most < 1:
        raise ValueError(f"most must be at least 1, got {most}")
    spans: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, n in enumerate(sizes):
        size = placed_bytes(n)
        if i > start and (i - start >= most or (room > 0 and used + size > room)):
            spans.append((start, i))
            start, used = i, 0
        used += size
    if start < len(sizes):
        spans.append((start, len(sizes)))
    return spans


class RequestCutter:
    """One data path's cutting: the segment its connections map (0: none, no byte bound) and
    the largest chunk the last GET returned. Threads: any (two ints, each set whole)."""

    def __init__(self, max_batch_keys: int) -> None:
        self.max_batch_keys = max_batch_keys
        self.segment_bytes = 0  # set when a connection maps its segment
        self.chunk_hint = 0

    def put_spans(self, sizes: Sequence[int]) -> list[tuple[int, int]]:
        """A PUT's requests, its chunks' sizes known."""
        return request_spans(sizes, self.max_batch_keys, self.segment_bytes)

    def get_into_spans(self, outs: Sequence[memoryview]) -> list[tuple[int, int]]:
        """A GET into ``outs``: sized by the last GET's largest chunk, at most each buffer."""
        return request_spans([min(v.nbytes, self.chunk_hint or v.nbytes) for v in outs], self.max_batch_keys,
                             self.segment_bytes)

    def get_spans(self, n: int) -> Iterator[tuple[int, int]]:
        """A GET of ``n`` keys, sized by the last GET's largest chunk; with none seen yet on
        shared memory, the first key alone first (its reply, given to :meth:`saw`, sets the
        size: the spans after it are made lazily)."""
        first = 1 if n > 1 and self.segment_bytes and not self.chunk_hint else 0
        if first:
            yield 0, 1
        for a, b in request_spans([self.chunk_hint] * (n - first), self.max_batch_keys, self.segment_bytes):
            yield first + a, first + b

    def saw(self, lengths: Sequence[object]) -> None:
        """A GET's results: the lengths of the chunks it returned (anything else is skipped)."""
        hint = max((n for n in lengths if isinstance(n, int)), default=0)
        if hint:
            self.chunk_hint = hint
