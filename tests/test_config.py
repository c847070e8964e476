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
    ({"grpc": {"backoff_s": 30}}, "grpc.backoff_s .* must not exceed grpc.backoff_max_s"),
    ({"redis": {"backoff_s": 0.5, "backoff_max_s": 0.1}}, "redis.backoff_s .* must not exceed"),
])
def test_invalid_values_name_field_and_range(bad: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.").replace(r"\.*", ".*")):
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


@pytest.mark.parametrize("text, message", [
    ("chunk_tokens: yes\n", r"chunk_tokens: expected an integer, got True"),
    ("disk:\n  read_threads: true\n", r"disk\.read_threads: expected an integer"),
    ("grpc:\n  timeout_s: .nan\n", r"grpc\.timeout_s: expected a finite number"),
    ("redis:\n  timeout_s: nan\n", r"redis\.timeout_s: expected a finite number"),
    ("grpc:\n  nodes: 50051\n", r"grpc\.nodes: expected a list"),
    ("grpc:\n  nodes:\n", r"grpc\.nodes: expected a list"),
    ("grpc:\n  nodes: [~, 'h:1']\n", r"grpc\.nodes\[0\]: expected a string"),
    ("on: 1\nfoo: 2\n", r"True: unknown setting \(YAML reads"),
    ("1: a\nfoo: 2\n", r"1: unknown setting"),
    pytest.param("cpu:\n  capacity_bytes: '" + "9" * 400 + "'\n", r"cpu\.capacity_bytes: .* too large", id="400-digit-size"),
])
def test_yaml_mistakes_are_config_errors_naming_the_field(tmp_path: Path, text: str, message: str) -> None:
    """YAML booleans are not integers, NaN does not slip past a range, a malformed node list
    or a non-string key is a ConfigError, not a TypeError, and a huge size is not an OverflowError."""
    f = tmp_path / "k.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message):
        KVTierConfig.load(f, env={})


@pytest.mark.parametrize("node", ["localhost:99999", "localhost", "http://h:50051", "::1:50051", "h:0"])
def test_grpc_nodes_must_be_host_port(node: str) -> None:
    with pytest.raises(ConfigError, match=r"grpc\.nodes\[1\]: .* not HOST:PORT"):
        KVTierConfig.from_dict({"grpc": {"nodes": ["h:1", node]}})
    assert KVTierConfig.from_dict({"grpc": {"nodes": "h:1,[::1]:50051"}}).grpc.nodes == ("h:1", "[::1]:50051")


def test_config_file_not_utf8_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "latin1.yaml"
    f.write_bytes(b"cpu:\n  capacity_bytes: 2GiB # caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin1\.yaml: not UTF-8"):
        KVTierConfig.load(f, env={})


def test_environment_mistakes(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match=r"grpc\.timeout_s: expected a finite number"):
        KVTierConfig.load(env={"KVTIER_GRPC__TIMEOUT_S": "nan"})
    with pytest.raises(ConfigError, match=r"KVTIER_CPU is also set.*section"):
        KVTierConfig.load(env={"KVTIER_CPU": "on", "KVTIER_CPU__CAPACITY_BYTES": "2GiB"})
    # Single-underscore and misspelt names are still ignored (other tools own KVTIER_*), but
    # not silently; a tool's own name gets no warning.
    with caplog.at_level("WARNING", logger="kvtier.config"):
        cfg = KVTierConfig.load(env={"KVTIER_DISK_PATH": "/mnt/nvme", "KVTIER_CHUNK_TOKEN": "512",
                                     "KVTIER_SGLANG_VENV": "/v", "KVTIER_SERVER_DISK__PATH": "/s"})
    assert cfg.disk.path != "/mnt/nvme" and cfg.chunk_tokens == 256
    warned = [r.getMessage() for r in caplog.records]
    assert any("did you mean KVTIER_DISK__PATH?" in m for m in warned)
    assert any("did you mean KVTIER_CHUNK_TOKENS?" in m for m in warned)
    assert len(warned) == 2
