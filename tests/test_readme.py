"""The README stays true: its configuration table is generated from kvtier.config, and its
Python API example runs, as printed, against its YAML (with the disk path moved to a
temporary directory)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from kvtier.cache import LoadedPrefix, PrefixCache, PrefixHit
from kvtier.config import KVTierConfig
from kvtier.keys import NamespaceSpec

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_config_table_matches_config() -> None:
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.table() in README, (
        "README config table is stale: run python scripts/config_reference.py and paste it")


def _api_blocks() -> tuple[str, str]:
    """The YAML and Python blocks of the README's "Python API" section."""
    section = README.split("## The Python API", 1)[1].split("\n## ", 1)[0]
    yaml_blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    py_blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(yaml_blocks) == 1 and len(py_blocks) == 1, "the API section has one yaml and one python block"
    return yaml_blocks[0], py_blocks[0]


def test_readme_python_api_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    yaml_text, code = _api_blocks()
    cfg = yaml.safe_load(yaml_text)
    assert cfg["disk"]["enabled"] is True
    cfg["disk"]["path"] = str(tmp_path / "disk")
    (tmp_path / "kvtier.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)  # the example opens "kvtier.yaml" from the working directory
    ns: dict[str, object] = {}
    exec(compile(code, "README.md (Python API)", "exec"), ns)

    tokens, kv, hit, loaded, spec = ns["tokens"], ns["kv"], ns["hit"], ns["loaded"], ns["spec"]
    assert isinstance(tokens, np.ndarray) and isinstance(kv, np.ndarray)
    assert isinstance(hit, PrefixHit) and isinstance(loaded, LoadedPrefix)
    assert isinstance(spec, NamespaceSpec)
    n = len(tokens)
    assert (hit.tokens, hit.chunks, hit.per_tier) == (n, 4, {"cpu": 4})
    assert loaded.tokens == n
    spans = [(s, min(s + 256, n)) for s in range(0, n, 256)]
    assert [bytes(p) for p in loaded.payloads] == [kv[:, :, s:e].tobytes() for s, e in spans]

    # The YAML was what the cache ran on: its disk tier kept the chunks for a fresh process.
    assert os.listdir(tmp_path / "disk")
    cache = PrefixCache.open(KVTierConfig.load("kvtier.yaml"), spec)
    try:
        again = cache.lookup(tokens)
        assert (again.tokens, again.per_tier) == (n, {"disk": 4})
    finally:
        cache.close()
