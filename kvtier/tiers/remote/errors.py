"""How a call to a kvtier-server node fails, shared by the node client and its data path.

A leaf module (it imports nothing of the remote tier), so that ``node`` and ``data_path`` both
import it and not each other.
"""

from __future__ import annotations

from typing import TypeVar

import grpc

from kvtier.chunk import header_names
from kvtier.protocol.frames import ProtocolError
from kvtier.tiers.base import CORRUPT, ERROR, NODE_DOWN, TIMEOUT, Miss

B = TypeVar("B", bytes, memoryview)

# Refusals of the request, not failures of the node: the node stays up.
REQUEST_ERRORS = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE})
REFUSALS = frozenset(c.name for c in REQUEST_ERRORS)
REQUEST_CODES = {c.value[0]: c.name for c in grpc.StatusCode}  # a data-path ERROR frame's code


class NodeError(Exception):
    """A call to a node failed. ``reason`` is the miss reason to report; ``down`` says whether
    the node itself failed (transport, timeout, auth: mark it down) rather than only this
    request being refused; ``code`` is the gRPC status name where there is one."""

    def __init__(self, reason: str, message: str, *, down: bool, code: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.down = down
        self.code = code


def check_chunk(key: bytes, chunk: B) -> B | Miss:
    """Cheap guard on what a node returns: a chunk header (checksummed) naming ``key``.
    The payload checksum is left to the reader that decodes the chunk."""
    return chunk if header_names(chunk, key) else Miss(CORRUPT)


def io_error(exc: BaseException, what: str) -> NodeError:
    """A data-path request's I/O failure: a timeout marks the node down; a protocol error or a
    dropped connection fails the request only."""
    if isinstance(exc, (TimeoutError, BlockingIOError)):
        return NodeError(TIMEOUT, f"{what}: timed out", down=True)
    if isinstance(exc, ProtocolError):
        return NodeError(ERROR, f"{what}: protocol error: {exc}", down=False)
    return NodeError(NODE_DOWN, f"{what}: {exc}", down=False)


def refused(error: tuple[int, str], what: str) -> NodeError:
    """A data-path ERROR frame ``(code, message)``: a refusal of the request, or a node failure
    for codes outside :data:`REFUSALS`."""
    code = REQUEST_CODES.get(error[0], "UNKNOWN")
    return NodeError(ERROR, f"{what}: {code}: {error[1]}", down=code not in REFUSALS, code=code)
