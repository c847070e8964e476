"""Child process for tests/test_disk_crash.py: writes chunks into a DiskTier until killed.

Usage: python -m tests._disk_writer PATH CAPACITY_BYTES O_DIRECT(0|1) SEED
Every chunk's bytes derive from its key (``crash_chunk``), so the parent can check any chunk
it finds after a ``kill -9``. Prints ``ready`` once the tier is open, then loops forever over
puts (new keys and overwrites), deletes and reads.
"""

from __future__ import annotations

import hashlib
import random
import sys

import numpy as np

from kvtier.chunk import encode_chunk
from kvtier.config import DiskTierConfig
from kvtier.tiers.base import Entry
from kvtier.tiers.disk import DiskTier

NAMESPACE = hashlib.sha256(b"crash-test").digest()
KEYS = 96


def crash_key(i: int) -> bytes:
    return hashlib.sha256(f"crash/{i}".encode()).digest()


def crash_chunk(key: bytes) -> bytes:
    """The one chunk ``key`` may map to: size (8-200 KiB) and payload seeded by the key."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    tokens = int(rng.integers(64, 1600))
    shape = (2, 2, tokens, 2, 8)
    payload = rng.integers(0, 256, size=int(np.prod(shape)) * 2, dtype=np.uint8).tobytes()
    return bytes(encode_chunk(NAMESPACE, key, "float16", shape, payload))


def main() -> None:
    path, capacity, direct, seed = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
    tier = DiskTier(DiskTierConfig(path=path, capacity_bytes=capacity, o_direct=direct))
    chunks = {i: crash_chunk(crash_key(i)) for i in range(KEYS)}
    rng = random.Random(seed)
    print("ready", flush=True)
    while True:
        i = rng.randrange(KEYS)
        roll = rng.random()
        if roll < 0.8:
            tier.put([Entry(crash_key(i), chunks[i])])
        elif roll < 0.9:
            tier.delete([crash_key(i)])
        else:
            tier.get([crash_key(i)])


if __name__ == "__main__":
    main()
