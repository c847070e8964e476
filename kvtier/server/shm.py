"""One data connection's shared-memory segment: a sealed memfd handed to the client over a
one-shot Unix socket, never a name anyone can open.

Why not a file in /dev/shm: a named segment can be opened by any process of the same uid
while the name exists (a watcher read tenants' chunks), and whoever can open it can
``ftruncate`` it, after which the server's next copy into the mapping dies of SIGBUS and
takes every tenant's cache with it. Here the server makes an anonymous ``memfd``, reserves
its pages, and seals it (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) *before* anyone else
holds it: no one, the client included, can change its size again, so the server's mapping
can never lose pages under it. The client gets the descriptor over an abstract Unix socket
whose random name is useless without the 128-bit ticket that only travels on the
(authenticated) data connection; the first peer that shows the ticket gets the fd, wrong
tickets are dropped, and the listener closes after one hand-off or :data:`HANDOFF_S`.

What the shm path still trusts (docs/server.md): the client may write anything into its own
segment at any time, so the server copies a PUT chunk out and verifies the copy (a chunk
rewritten mid-copy fails its checksum); the client may punch holes in it, which reads as
zeros and refills with fresh pages, never a fault. Processes that can ``ptrace`` the server
or the client (same uid without Yama restrictions, root) can read their memory anyway, this
segment included: the shm path protects tenants from each other, not from the host.

The tenant's arena (kvtier.server.arena_refs) may travel in the same hand-off as a second
descriptor: a read-only one (reopened through /proc with ``O_RDONLY``), of a memfd sealed the
same way, so the client can map it for reading only and never change its size.

Threads: a :class:`Segment` belongs to its connection's thread.
"""

from __future__ import annotations

import fcntl
import hmac
import mmap
import os
import secrets
import select
import socket
import time

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
HANDOFF_S = 5.0  # the client asks for the fd right after SHM_READY; anything slower gives up
TICKET_WAIT_S = 0.25
TICKET_CHARS = 32
AVAILABLE = hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


class Segment:
    """Created by :meth:`create`, offered by :meth:`hand_off`, then only mapped here
    (``view``) until :meth:`close`."""

    def __init__(self) -> None:
        self.fd = -1
        self.mapping: mmap.mmap | None = None
        self.view: memoryview | None = None
        self.listener: socket.socket | None = None
        self.address = ""
        self.ticket = ""
        self.arena_fd = -1  # the tenant arena's read-only descriptor, handed off with ours
        self.arena_offered = False  # arena_fd went with the offer
        self.arena_mapped = False  # ... and the client said it mapped it

    @property
    def pending(self) -> bool:
        """Created and offered, the client's SHM_MAPPED not yet received."""
        return self.mapping is not None and self.view is None

    def create(self, size: int, arena_fd: int = -1) -> None:
        """Reserve and seal ``size`` bytes; listen for the hand-off, which also gives the
        client ``arena_fd`` (this segment owns it from now on and closes it) where it is one.
        Raises OSError (no memory, no memfd): the connection then stays on the socket."""
        self.arena_fd = arena_fd
        try:
            self.fd = os.memfd_create("kvtier-shm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            # Every page now: a fault later (no memory) must fail here, not SIGBUS a copy.
            os.posix_fallocate(self.fd, 0, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self.mapping = mmap.mmap(self.fd, size)
            self.address = f"kvtier-shm-{secrets.token_hex(16)}"
            self.ticket = secrets.token_hex(TICKET_CHARS // 2)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            self.listener = listener
            listener.bind("\0" + self.address)  # abstract: no file, gone with the socket
            listener.listen(4)
        except OSError:
            self.close()
            raise

    def hand_off(self, conn: socket.socket) -> bool:
        """Give the fd to the first local peer that shows the ticket, within HANDOFF_S; stop
        early when ``conn`` (the data connection) has something to read (the client said
        SHM_MAPPED(0) without asking). Closes the listener and our fd either way."""
        listener = self.listener
        assert listener is not None
        deadline = time.monotonic() + HANDOFF_S
        try:
            while (left := deadline - time.monotonic()) > 0:
                ready, _, _ = select.select([listener, conn], [], [], left)
                if listener not in ready:
                    return False  # timed out, or the client moved on
                peer, _ = listener.accept()
                with peer:
                    # The client sends its ticket as it connects: a local peer that connects and
                    # says nothing delays the real one by TICKET_WAIT_S at most, not HANDOFF_S.
                    peer.settimeout(max(0.01, min(TICKET_WAIT_S, deadline - time.monotonic())))
                    try:
                        if hmac.compare_digest(_recv_exact(peer, TICKET_CHARS), self.ticket.encode()):
                            fds = [self.fd] if self.arena_fd < 0 else [self.fd, self.arena_fd]
                            socket.send_fds(peer, [b"\x01"], fds)
                            return True
                    except OSError:  # that peer stalled or hung up: wait for the next
                        continue
            return False
        except OSError:  # the listener or the data connection failed
            return False
        finally:
            self._close_handoff()

    def _close_handoff(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        for fd in (self.fd, self.arena_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.arena_fd = -1

    def close(self) -> bool:
        """Unmap the segment; False when a view of it is still alive (kept by an exception's
        frames, say): ``mapping`` stays set so the owner can collect and call again."""
        self._close_handoff()
        self.view = None
        self.arena_offered = self.arena_mapped = False
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:
                return False
            self.mapping = None
        return True


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            break
        data += part
    return data
