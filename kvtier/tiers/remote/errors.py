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


def rpc_error(exc: grpc.RpcError, what: str) -> NodeError:
    """A failed RPC: a deadline or transport failure is the node's (``down``), a refusal of the
    request (:data:`REQUEST_ERRORS`) is not."""
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    message = f"{what}: {code.name if code else '?'}: {details}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return NodeError(TIMEOUT, message, down=True, code="DEADLINE_EXCEEDED")
    if code in REQUEST_ERRORS:
        return NodeError(ERROR, message, down=False, code=code.name)
    if code == grpc.StatusCode.UNAVAILABLE:
        return NodeError(NODE_DOWN, message, down=True, code=code.name)
    return NodeError(ERROR, message, down=True, code=code.name if code else "UNKNOWN")


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


def no_time_left(what: str) -> NodeError:
    """A request never sent because its deadline had passed: the caller is late (a late wave
    or retry), the node is not to blame (``down=False``)."""
    return NodeError(TIMEOUT, f"{what}: no time left before the request was sent", down=False)


def refused(error: tuple[int, str], what: str) -> NodeError:
    """A data-path ERROR frame ``(code, message)``: a refusal of the request, or a node failure
    for codes outside :data:`REFUSALS`."""
    code = REQUEST_CODES.get(error[0], "UNKNOWN")
    return NodeError(ERROR, f"{what}: {code}: {error[1]}", down=code not in REFUSALS, code=code)
