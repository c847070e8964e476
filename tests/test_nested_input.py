"""Readers of outside JSON and YAML refuse input nested deeper than the parser goes with the
error their contract names (a RecursionError escaped each of them): a checkpoint's safetensors
header (OSError), a config file (ConfigError), a dashboard peer's reply (ValueError), the vLLM
connector's lookup socket (ConnectionError)."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pytest

from kvtier.checkpoint import checkpoint_revision
from kvtier.config_sources import read_yaml
from kvtier.errors import ConfigError
from kvtier.server.dashboard import parse_http_reply

DEEP = 200_000  # far past the parsers' recursion limit, and a few hundred KiB only


def test_a_deep_safetensors_header_is_an_oserror_not_a_recursion(tmp_path: Path) -> None:
    header = b"[" * DEEP + b"]" * DEEP
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(OSError, match="not JSON"):
        checkpoint_revision(str(tmp_path))


def test_a_deep_yaml_config_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text("[" * DEEP)
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_yaml(path)


def test_a_deep_peer_reply_is_a_value_error() -> None:
    body = b"[" * DEEP + b"]" * DEEP
    with pytest.raises(ValueError, match="nested too deep"):
        parse_http_reply(b"HTTP/1.1 200 OK\r\n\r\n" + body)


def test_a_deep_lookup_header_is_a_connection_error() -> None:
    from kvtier_vllm import ipc

    a, b = socket.socketpair()
    try:
        header = b"[" * 50_000 + b"]" * 50_000
        a.sendall(struct.pack("<I", len(header)) + header + struct.pack("<I", 0))
        with pytest.raises(ConnectionError, match="not JSON"):
            ipc._recv(b)
    finally:
        a.close()
        b.close()
