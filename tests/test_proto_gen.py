"""The committed generated code matches proto/kvtier/v1/kvtier.proto (CI guard)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_script():  # scripts/ is not a package: load the generator by path
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = module
    spec.loader.exec_module(module)
    return module


def test_descriptor_matches_proto(tmp_path: Path) -> None:
    """Version-independent: the schema compiled now equals the one the committed code carries."""
    gen = _load_script()
    gen.generate(tmp_path)
    from google.protobuf import descriptor_pb2

    from kvtier.protocol.gen import kvtier_pb2

    committed = descriptor_pb2.FileDescriptorProto()
    kvtier_pb2.DESCRIPTOR.CopyToProto(committed)
    text = (tmp_path / "kvtier_pb2.py").read_text()
    start = text.index("AddSerializedFile(") + len("AddSerializedFile(")
    fresh = descriptor_pb2.FileDescriptorProto.FromString(eval(text[start:text.index(")\n", start)]))
    assert fresh == committed, "kvtier_pb2 is stale: run python scripts/gen_proto.py"


def test_generated_files_match_byte_for_byte(tmp_path: Path) -> None:
    gen = _load_script()
    from kvtier.protocol import gen as committed

    if committed.GENERATED_WITH != f"grpcio-tools {gen.tools_version()}":
        pytest.skip(f"committed code was made with {committed.GENERATED_WITH}, "
                    f"installed is {gen.tools_version()} (the descriptor test still guards the schema)")
    gen.generate(tmp_path)
    assert gen.differences(tmp_path, gen.GEN) == [], "run python scripts/gen_proto.py"
    assert gen.main(["--check"]) == 0


def test_the_test_extra_pins_the_generator_the_committed_code_was_made_with() -> None:
    """So that CI installs that version and the byte-for-byte test above runs, not skips."""
    import tomllib

    from kvtier.protocol import gen as committed

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = [req for req in extras["test"] if req.startswith("grpcio-tools")]
    assert pins == [f"grpcio-tools=={committed.GENERATED_WITH.split()[-1]}"], pins
