"""LMCache's ``lm://`` server as a peer for bench/remote.py (optional: skipped when absent).

The server is LMCache's own (``python -m lmcache.v1.server HOST PORT cpu``: a dict behind a
lock, a thread per connection, no eviction, auth or checksums), run by the Python of a venv
that has ``lmcache==0.5.6`` (LMCache pins packages that must not enter kvtier's environment):
``KVTIER_LMCACHE_PYTHON`` or ``/work/venvs/lmcache/bin/python``. Set one up with::

    python -m venv --system-site-packages /work/venvs/lmcache
    echo torch==2.13.0 > /tmp/pin.txt && /work/venvs/lmcache/bin/pip install -c /tmp/pin.txt lmcache==0.5.6

The client here speaks LMCache's wire format (``lmcache/v1/protocol.py``: a 186-byte
``ClientMetaMessage`` of nine int32 and a 150-byte key string; a 36-byte ``ServerMetaMessage``
reply, then the value) with kvtier's client model: blocking sockets, one connection per
thread, ``recv_into`` preallocated buffers, values sent from the caller's buffer (no copy).
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import time
from pathlib import Path

_CLIENT = struct.Struct("iiiiiiiii150s")
_SERVER = struct.Struct("iiiiiiiii")
PUT, GET = 1, 2  # ClientCommand
SUCCESS = 200  # ServerReturnCode
BINARY = 5  # MemoryFormat: a plain byte value, shape [length, 0, 0, 0]
HALF, UINT8 = 2, 6  # DTYPE_TO_INT


def lmcache_python() -> str | None:
    """The venv Python that has lmcache, or None (the comparison is then skipped)."""
    exe = os.environ.get("KVTIER_LMCACHE_PYTHON", "/work/venvs/lmcache/bin/python")
    if not Path(exe).exists():
        return None
    ok = subprocess.run([exe, "-c", "import lmcache.v1.server"], capture_output=True, timeout=120)
    return exe if ok.returncode == 0 else None


def start_server(python: str) -> tuple[subprocess.Popen[bytes], int]:
    """LMCache's server on a free loopback port; the caller terminates it."""
    from tests.redis_servers import free_port  # below the ephemeral range: see its docstring

    port = free_port()
    proc = subprocess.Popen([python, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lmcache server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("lmcache server did not start within 120 s")


def _key(i: int) -> bytes:
    return f"kvtier-bench@1@0@{i:x}@half".encode().ljust(150)


class LMCacheClient:
    """One connection; not thread-safe (a bench thread each)."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reply = bytearray(_SERVER.size)

    def put(self, i: int, value: memoryview) -> None:
        n = value.nbytes
        head = _CLIENT.pack(PUT, n, BINARY, UINT8, 0, n, 0, 0, 0, _key(i))
        self.sock.sendmsg([head, value])  # small header + value: one call, no join
        # LMCache's PUT has no reply.

    def get_into(self, i: int, out: memoryview) -> int:
        """Bytes read into ``out``, or -1 on a miss."""
        self.sock.sendall(_CLIENT.pack(GET, 0, BINARY, UINT8, 0, 0, 0, 0, 0, _key(i)))
        self._recv_exact(memoryview(self._reply))
        code, length = _SERVER.unpack(self._reply)[:2]
        if code != SUCCESS:
            return -1
        self._recv_exact(out[:length])
        return length

    def get_many_into(self, ids: list[int], outs: list[memoryview]) -> int:
        """GETs of ``ids`` pipelined on this connection (LMCache's server answers in order):
        every request header in one send, then each reply read into its buffer. Hits."""
        self.sock.sendall(b"".join(_CLIENT.pack(GET, 0, BINARY, UINT8, 0, 0, 0, 0, 0, _key(i)) for i in ids))
        hits = 0
        for out in outs:
            self._recv_exact(memoryview(self._reply))
            code, length = _SERVER.unpack(self._reply)[:2]
            if code == SUCCESS:
                self._recv_exact(out[:length])
                hits += 1
        return hits

    def _recv_exact(self, view: memoryview) -> None:
        got = 0
        while got < view.nbytes:
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("lmcache server closed the connection")
            got += n

    def close(self) -> None:
        self.sock.close()
