"""How a data-path verb cuts its keys into requests: at most ``max_batch_keys`` each, and on
shared memory no more bytes than the connection's segment holds.

Why: the server places a GET's chunks in the segment one after another from its start, and
the client a PUT's; what does not fit travels inline over the socket (and a PUT's chunk is
first framed into fresh memory). A request of 64 chunks of 4 MiB through a 32 MiB segment
sent 7/8 of its bytes that way. Several requests that each fit cost a round trip apiece (the
segment is reused once a request's reply is in) and keep every chunk on the shared path.
"""

from __future__ import annotations

from collections.abc import Sequence

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
