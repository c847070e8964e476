"""kvtier_sglang.written: the bounded set of page keys a backend stored, for clear()."""

from __future__ import annotations

import logging
import threading

import pytest
from kvtier_sglang.written import WrittenKeys


def _keys(lo: int, hi: int) -> list[bytes]:
    return [i.to_bytes(32, "little") for i in range(lo, hi)]


def test_keys_beyond_the_limit_are_counted_not_kept_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    written = WrittenKeys(limit=10)
    with caplog.at_level(logging.WARNING, logger="kvtier_sglang.written"):
        assert written.add(_keys(0, 6)) == 0
        assert written.add(_keys(3, 6)) == 0  # already tracked: still 6 keys
        assert written.add(_keys(6, 9)) == 0
        assert written.add(_keys(100, 104)) == 3  # room for one
        assert written.add(_keys(200, 202)) == 2
    assert caplog.text.count("newer pages are not tracked") == 1
    assert sorted(written.take_all()) == sorted(_keys(0, 9) + _keys(100, 101))
    assert written.take_all() == [] and written.add(_keys(0, 10)) == 0  # emptied: room again


def test_concurrent_adds_never_pass_the_limit() -> None:
    written = WrittenKeys(limit=1000)
    untracked: list[int] = []
    threads = [threading.Thread(target=lambda t=t: untracked.append(written.add(_keys(t * 400, t * 400 + 400))))
               for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(written.take_all()) == 1000 and sum(untracked) == 600
