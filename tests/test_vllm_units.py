"""The vLLM connector's engine-free parts: extra-config parsing, tenant salts, lookup socket."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connectors"))

from kvtier_vllm.ipc import LookupClient, LookupServer, socket_path
from kvtier_vllm.settings import check_block_size, load_settings, namespace_salt

from kvtier.errors import ConfigError
from kvtier.keys import tenant_salt


def test_extra_config_splits_connector_section_from_kvtier_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_DISK__CAPACITY_BYTES", "2GiB")
    cfg, vs = load_settings({"chunk_tokens": 512, "disk": {"enabled": True, "path": "/tmp/x"},
                             "vllm": {"async_load": "never", "lookup_timeout_s": 0.2, "model_id": "m"}})
    assert cfg.chunk_tokens == 512 and cfg.disk.enabled and cfg.disk.capacity_bytes == 2 << 30
    assert vs.async_load == "never" and vs.lookup_timeout_s == 0.2 and vs.model_id == "m"
    cfg, vs = load_settings(None)
    assert cfg.chunk_tokens == 256 and vs.prefetch


@pytest.mark.parametrize("extra, field", [
    ({"chunk_tokens": 0}, "chunk_tokens"),
    ({"cpu": {"capacity_bytes": "lots"}}, "cpu.capacity_bytes"),
    ({"no_such_thing": 1}, "no_such_thing"),
    ({"vllm": {"async_load": "sometimes"}}, "vllm.async_load"),
    ({"vllm": {"lookup_timeout_s": -1}}, "vllm.lookup_timeout_s"),
    ({"vllm": {"bogus": 1}}, "vllm.bogus"),
    ({"vllm": "yes"}, "vllm"),
    ({"salt_hex": "xyz"}, "salt_hex"),
])
def test_invalid_extra_config_is_a_config_error_naming_the_field(extra: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_settings(extra)


def test_chunk_must_be_a_multiple_of_the_engine_block() -> None:
    cfg, _ = load_settings({"chunk_tokens": 384})
    check_block_size(cfg, 128)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        check_block_size(cfg, 256)


def test_namespace_salt_per_tenant() -> None:
    plain, _ = load_settings({})
    assert namespace_salt(plain, None) == b"" and namespace_salt(plain, "t1") == b"t1"
    secret, _ = load_settings({"salt_hex": "00ff", "tenant": "default"})
    assert namespace_salt(secret, "t1") == tenant_salt(b"\x00\xff", "t1")
    assert namespace_salt(secret, None) == tenant_salt(b"\x00\xff", "default")
    assert namespace_salt(secret, "t1") != namespace_salt(secret, "t2")


def test_lookup_socket_roundtrip_and_private_directory(tmp_path: Path) -> None:
    path = socket_path("engine/../x", 0, 1, str(tmp_path / "socks"))
    assert Path(path).parent.stat().st_mode & 0o777 == 0o700 and "/../" not in path
    seen: list[tuple[dict, bytes]] = []

    def handler(header: dict, blob: bytes) -> dict:
        seen.append((header, blob))
        if header.get("op") == "boom":
            raise ValueError("bad op")
        return {"tokens": len(blob) // 4}

    server = LookupServer(path, handler)
    client = LookupClient(path, timeout_s=2)
    assert client.call({"op": "lookup"}, b"\x01\x00\x00\x00" * 5) == {"tokens": 5}
    assert client.call({"op": "boom"}) == {"error": "bad op"}
    assert client.call({"op": "lookup"}) == {"tokens": 0}  # the connection survived the error
    server.close()
    assert client.call({"op": "lookup"}) is None  # server gone: a miss, not an exception
    client.close()


def test_lookup_client_times_out_and_recovers(tmp_path: Path) -> None:
    path = socket_path("slow", 0, 0, str(tmp_path))
    release = threading.Event()

    def handler(header: dict, blob: bytes) -> dict:
        if header.get("slow"):
            release.wait(5)
        return {"ok": header.get("n")}

    server = LookupServer(path, handler)
    client = LookupClient(path, timeout_s=0.1)
    t0 = time.monotonic()
    assert client.call({"slow": True, "n": 1}) is None
    assert time.monotonic() - t0 < 1.5
    release.set()
    # A fresh connection: the late answer to the first call is never read as this one's.
    assert client.call({"n": 2}) == {"ok": 2}
    assert LookupClient(str(tmp_path / "absent.sock"), 0.1).call({}) is None
    server.close()
