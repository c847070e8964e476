"""kvtier.memcopy.copy_into: the bytes arrive whole on both sides of its size switch, with and
without streaming stores, at any alignment, from any contiguous buffer (bytes, a read-only
mapping, a typed array), and a length mismatch is an error naming both lengths, with the
destination untouched."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvtier.memcopy import SMALL, copy_into


@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "streaming"])
@pytest.mark.parametrize("n", [0, 1, SMALL - 1, SMALL, SMALL + 1, (1 << 20) + 7])
def test_every_byte_arrives(n: int, streaming: bool) -> None:
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    for skew in (0, 1, 15):  # streaming stores need 16-byte alignment: the head and tail too
        with mmap.mmap(-1, n + 16) as m:
            dst = memoryview(m)[skew:skew + n]
            copy_into(dst, src, streaming=streaming)
            assert bytes(dst) == src
            assert bytes(m[:skew]) == bytes(skew) and bytes(m[skew + n:]) == bytes(16 - skew)
            dst.release()


def test_from_a_read_only_view_and_into_a_typed_buffer() -> None:
    src = np.arange(SMALL, dtype=np.float32)  # 4 * SMALL bytes
    out = np.zeros(SMALL, dtype=np.float32)
    copy_into(memoryview(out), memoryview(src.tobytes()).toreadonly())
    assert np.array_equal(out, src)


@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "streaming"])
def test_a_length_mismatch_names_both_and_writes_nothing(streaming: bool) -> None:
    dst = bytearray(SMALL * 2)
    with pytest.raises(ValueError, match=f"{SMALL * 2 + 1} bytes into a buffer of {SMALL * 2}"):
        copy_into(memoryview(dst), b"\x01" * (SMALL * 2 + 1), streaming=streaming)
    assert dst == bytearray(SMALL * 2)
