"""Differential fuzz of the GET reply reader, kvtier/_replyloop.c against read_reply's Python
loop, with the mutation anywhere in the reply.

tests/test_replyloop_fuzz.py rewrites header fields of the first frame only (and flips or cuts
bytes anywhere): the C loop then stops at once and the Python loop does the rest. Here the
rewritten field (type, flags, index, length: huge, zero, off by one, past the chunk limit, past
the target) is in any frame's header, so the C loop is mid-run when it meets it, with earlier
bodies in their targets and the header read in the same call as the previous body. Both loops
must give the same outcome: the same results, buffers and overflow notes, or the same error
type and message (tests/test_replyloop_fuzz.py's ``_outcome``: a real TCP pair, the reply sent
in awkward pieces, the sender then closes so nothing can hang).
"""

from __future__ import annotations

import random

import pytest

from kvtier.protocol.frames import encode_chunk, encode_chunk_ref, encode_miss
from tests.test_frames_fuzz import _frame_starts
from tests.test_replyloop_fuzz import LIMITS, check_loops_agree


def _reply(rng: random.Random) -> tuple[int, bytes]:
    """(keys asked, a mostly-CHUNK reply with one to three header fields rewritten)."""
    n = rng.randint(2, 10)
    parts: list[bytes] = []
    for i in range(n):
        kind = rng.choices(["chunk", "miss", "ref"], [10, 1, 0.3])[0]
        frame = (encode_chunk(i, rng.randbytes(rng.choice([0, 1, 16, 4096, 70_000]))) if kind == "chunk"
                 else encode_miss(i, "absent") if kind == "miss" else encode_chunk_ref(i, 0, 10))
        parts += [bytes(p) for p in frame]
    data = bytearray(b"".join(parts))
    starts = _frame_starts(bytes(data))
    for _ in range(rng.randint(1, 3)):
        head = rng.choice(starts[1:])  # past the first frame: the C loop is mid-run
        field = rng.randrange(5)
        if field == 0:
            data[head + 2] = rng.choice([1, 3, 4, 5, 6, 7, 255])  # type
        elif field == 1:
            data[head + 3] = rng.choice([1, 2, 4, 8, 12, 128])  # flags
        elif field == 2:
            index = int.from_bytes(data[head + 4 : head + 8], "little")  # (an earlier edit may have set it)
            new = rng.choice([index + 1, index - 1, 0, (1 << 32) - 1]) % (1 << 32)
            data[head + 4 : head + 8] = new.to_bytes(4, "little")
        else:
            length = int.from_bytes(data[head + 8 : head + 16], "little")
            new = rng.choice([0, length + 1, max(length - 1, 0), LIMITS.max_chunk_bytes, LIMITS.max_chunk_bytes + 1,
                              80_001, (1 << 64) - 1, 1 << 63])
            data[head + 8 : head + 16] = (new % (1 << 64)).to_bytes(8, "little")
    if rng.random() < 0.3:
        del data[rng.randrange(len(data)) :]
    return n, bytes(data)


@pytest.mark.parametrize("seed", range(120))
def test_c_and_python_loops_agree_on_a_mutation_mid_run(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    check_loops_agree(*_reply(random.Random(seed)), seed, monkeypatch)
