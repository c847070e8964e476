"""Polling until a condition holds, for tests that watch another process (a server, a scraper).

:func:`wait_for` returns the first truthy value ``probe()`` gives, or fails the test naming
``what`` and the last value seen once ``timeout`` s have passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 10.0, interval: float = 0.1) -> Any:
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout}s (last: {last!r})")
