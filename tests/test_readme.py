"""The README's configuration table is generated from kvtier.config and must stay in step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_config_table_matches_config() -> None:
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.table() in (ROOT / "README.md").read_text(), (
        "README config table is stale: run python scripts/config_reference.py and paste it")
