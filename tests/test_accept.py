"""kvtier.protocol.accept.Acceptor: which accept() failures end a listener's loop (only a
closed listener or draining), which are waited out (out of descriptors or memory) and which
skip one connection. A scripted listener raises the errors a kernel gives; the last test
uses a real socket."""

from __future__ import annotations

import errno
import logging
import socket
import threading

import pytest

from kvtier.protocol import accept
from kvtier.protocol.accept import Acceptor


class ScriptedListener:
    """accept() raises each scripted errno in turn, then hands out a real connected socket."""

    def __init__(self, errnos: list[int]) -> None:
        self.errnos = list(errnos)
        self.calls = 0
        self.closed = False

    def accept(self) -> tuple[socket.socket, str]:
        self.calls += 1
        if self.errnos:
            code = self.errnos.pop(0)
            raise OSError(code, f"scripted {errno.errorcode[code]}")
        a, b = socket.socketpair()
        b.close()
        return a, "peer"

    def fileno(self) -> int:
        return -1 if self.closed else 3


@pytest.fixture(autouse=True)
def fast_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accept, "RETRY_S", 0.001)


@pytest.mark.parametrize("code", sorted(accept.EXHAUSTED))
def test_out_of_a_resource_is_waited_out_with_one_warning(code: int, caplog: pytest.LogCaptureFixture) -> None:
    listener = ScriptedListener([code] * 5)
    acceptor = Acceptor(listener, lambda: False, "test")  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="kvtier.protocol.accept"):
        got = acceptor.next()
    assert got is not None and got[1] == "peer"
    got[0].close()
    assert listener.calls == 6 and acceptor.exhausted.count == 5
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "1 time(s)" in warnings[0].getMessage()  # at the first failure only


@pytest.mark.parametrize("code", [errno.ECONNABORTED, errno.EPROTO, errno.EPERM])
def test_a_peer_gone_before_accept_is_skipped(code: int) -> None:
    listener = ScriptedListener([code, code])
    acceptor = Acceptor(listener, lambda: False, "test")  # type: ignore[arg-type]
    got = acceptor.next()
    assert got is not None and acceptor.exhausted.count == 0 and listener.calls == 3
    got[0].close()


def test_draining_or_a_closed_listener_ends_the_loop() -> None:
    draining = ScriptedListener([errno.EMFILE])
    assert Acceptor(draining, lambda: True, "test").next() is None  # type: ignore[arg-type]
    closed = ScriptedListener([errno.EMFILE])
    closed.closed = True
    assert Acceptor(closed, lambda: False, "test").next() is None  # type: ignore[arg-type]
    for code in (errno.EBADF, errno.EINVAL):
        assert Acceptor(ScriptedListener([code]), lambda: False, "test").next() is None  # type: ignore[arg-type]


def test_a_real_listener_shut_down_from_another_thread_ends_a_blocked_accept() -> None:
    """What the data plane's stop_accepting does: shutdown + close wake accept() with EINVAL."""
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(Acceptor(listener, lambda: False, "t").next()))
    thread.start()
    with socket.create_connection(listener.getsockname()):
        thread.join(5)
    assert got and got[0] is not None
    got[0][0].close()  # type: ignore[index]
    got.clear()
    thread = threading.Thread(target=lambda: got.append(Acceptor(listener, lambda: False, "t").next()))
    thread.start()
    listener.shutdown(socket.SHUT_RDWR)
    listener.close()
    thread.join(5)
    assert not thread.is_alive() and got == [None]
