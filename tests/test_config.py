"""Typed config: YAML < env < dict precedence, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import KVTierConfig, parse_size
from kvtier.errors import ConfigError


def test_defaults_are_valid_and_embedded() -> None:
    cfg = KVTierConfig.load(env={})
    assert cfg.cpu.enabled and not cfg.disk.enabled and cfg.chunk_tokens == 256


def test_precedence(tmp_path: Path) -> None:
    f = tmp_path / "kvtier.yaml"
    f.write_text("chunk_tokens: 128\ndisk:\n  enabled: true\n  path: /a\n  capacity_bytes: 2GiB\n")
    cfg = KVTierConfig.load(f, env={"KVTIER_DISK__PATH": "/b", "KVTIER_CODEC": "lz4"},
                            overrides={"codec": "zstd"})
    assert cfg.chunk_tokens == 128 and cfg.disk.enabled and cfg.disk.path == "/b"
    assert cfg.disk.capacity_bytes == 2 << 30 and cfg.codec == "zstd"


def test_engine_extra_config_dict() -> None:
    cfg = KVTierConfig.from_dict({"grpc": {"enabled": "true", "nodes": ["h:1", "h:2"]},
                                  "store": {"write_policy": "write_back"}})
    assert cfg.grpc.enabled and cfg.grpc.nodes == ("h:1", "h:2")
    assert cfg.store.write_policy == "write_back"


@pytest.mark.parametrize("bad, field", [
    ({"cpu": {"capacity_bytes": 10}}, "cpu.capacity_bytes"),
    ({"codec": "gzip"}, "codec"),
    ({"store": {"queue_depth": -1}}, "store.queue_depth"),
    ({"grpc": {"replication": 0}}, "grpc.replication"),
    ({"disk": {"enabled": "maybe"}}, "disk.enabled"),
    ({"chunk_tokens": "many"}, "chunk_tokens"),
    ({"nonsense": 1}, "nonsense"),
    ({"cpu": 5}, "cpu"),
    ({"salt_hex": "not-hex"}, "salt_hex"),
])
def test_invalid_values_name_field_and_range(bad: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        KVTierConfig.from_dict(bad)


def test_yaml_errors_are_clear(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("cpu: [1, 2\n")
    with pytest.raises(ConfigError, match="YAML"):
        KVTierConfig.load(f, env={})
    with pytest.raises(ConfigError, match="missing.yaml"):
        KVTierConfig.load(tmp_path / "missing.yaml", env={})


def test_sizes() -> None:
    assert parse_size("4GiB") == 4 << 30 and parse_size("1.5MB") == 1_500_000
    assert parse_size(123) == 123
    with pytest.raises(ConfigError):
        parse_size("lots")


def test_kvtier_variables_that_are_not_settings_are_left_to_their_owners() -> None:
    """KVTIER_SERVER_* (kvtier-server's) and tools' variables (KVTIER_SGLANG_VENV, ...) do not
    break the library's config; an unknown field inside a known section still does."""
    cfg = KVTierConfig.load(env={"KVTIER_SERVER_PORT": "50051", "KVTIER_SGLANG_VENV": "/v",
                                 "KVTIER_TRACE": "t.jsonl", "KVTIER_CODEC": "lz4"})
    assert cfg.codec == "lz4"
    with pytest.raises(ConfigError, match="disk.pth"):
        KVTierConfig.load(env={"KVTIER_DISK__PTH": "/x"})
