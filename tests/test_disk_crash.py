"""kill -9 a process writing into a DiskTier at random moments; after each kill the directory
must reopen with no torn file found and serve only exact, verified chunks."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.chunk import decode_chunk
from kvtier.config import DiskTierConfig
from kvtier.tiers.base import CORRUPT, Miss
from kvtier.tiers.disk import DiskTier
from tests._disk_writer import KEYS, NAMESPACE, crash_chunk, crash_key

ROOT = Path(__file__).resolve().parent.parent
CAPACITY = 2 << 20  # ~20 chunks of 8-200 KiB: the writer evicts (and reuses files) constantly
KILLS_PER_MODE = 12
BUDGET_S = 50.0


def _run_writer_and_kill(path: Path, direct: bool, seed: int, rng: random.Random) -> None:
    child = subprocess.Popen(
        [sys.executable, "-m", "tests._disk_writer", str(path), str(CAPACITY), "1" if direct else "0", str(seed)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # blocks until the tier is open and the loop starts
        assert line.strip() == "ready", f"writer failed to start: {line!r} {child.stderr.read() if child.stderr else ''}"
        time.sleep(rng.uniform(0.005, 0.25))
        assert child.poll() is None, "writer died before it was killed"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)  # reaped: its pid is dead, so its temp files count as stale
        for stream in (child.stdout, child.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.slow
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_kill_9_never_leaves_a_torn_chunk(tmp_path: Path, direct: bool) -> None:
    expected = {crash_key(i): crash_chunk(crash_key(i)) for i in range(KEYS)}
    rng = random.Random(1234 + direct)
    start = time.monotonic()
    served = 0
    for kill in range(KILLS_PER_MODE):
        assert time.monotonic() - start < BUDGET_S, f"only {kill} kills fit in the time budget"
        _run_writer_and_kill(tmp_path, direct, seed=kill, rng=rng)
        tier = DiskTier(DiskTierConfig(path=str(tmp_path), capacity_bytes=CAPACITY, o_direct=direct))
        try:
            stats = tier.rebuild_stats
            assert stats.bad == 0, f"kill {kill}: {stats.bad} torn or bad files found at start-up"
            assert not list(tmp_path.rglob("*.tmp")), "temp files of the dead writer were left behind"
            for key, value in zip(expected, tier.get(list(expected))):
                if isinstance(value, Miss):
                    assert value.reason != CORRUPT, f"kill {kill}: a corrupt file was found on read"
                    continue
                served += 1
                assert value == expected[key]
                decode_chunk(value, namespace=NAMESPACE, key=key, verify=True)
            usage = tier.usage()
            assert usage.used_bytes <= usage.capacity_bytes
            assert usage.entries == stats.files
            assert tier.check() == []
        finally:
            tier.close()
    assert served > KILLS_PER_MODE, "the writer must have left chunks to check"
