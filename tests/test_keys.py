"""Key schema kvtier/v1: recomputed from the checked-in vectors with plain hashlib/struct."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from kvtier.keys import (
    KVLayout,
    NamespaceSpec,
    chunk_keys,
    chunk_spans,
    namespace_id,
    tenant_salt,
    tokens_to_bytes,
)

VECTORS = json.loads((Path(__file__).parent / "vectors" / "keys_v1.json").read_text())


def _field(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def _plain_namespace(case: dict) -> bytes:
    lay = case["layout"]
    ints = struct.pack("<7I", lay["num_layers"], lay["kv"], lay["num_kv_heads"], lay["head_dim"],
                       lay["chunk_tokens"], case["rank"], case["world_size"])
    data = b"".join([_field(b"kvtier/v1"), _field(case["model_id"].encode()),
                     _field(case["model_revision"].encode()), _field(case["kv_dtype"].encode()),
                     _field(ints), _field(bytes.fromhex(case["salt_hex"]))])
    return hashlib.sha256(data).digest()


def _plain_keys(ns: bytes, tokens: list[int], c: int) -> list[bytes]:
    keys, prev = [], ns
    for i in range(0, len(tokens), c):
        chunk = b"".join(struct.pack("<I", t) for t in tokens[i:i + c])
        prev = hashlib.sha256(prev + chunk).digest()
        keys.append(prev)
    return keys


@pytest.mark.parametrize("case", VECTORS, ids=lambda c: c["model_id"])
def test_vectors_recomputed_with_plain_hashlib(case: dict) -> None:
    ns = _plain_namespace(case)
    assert ns.hex() == case["namespace_hex"]
    assert [k.hex() for k in _plain_keys(ns, case["tokens"], case["chunk_tokens"])] == case["keys_hex"]


@pytest.mark.parametrize("case", VECTORS, ids=lambda c: c["model_id"])
def test_library_matches_vectors(case: dict) -> None:
    spec = NamespaceSpec(case["model_id"], KVLayout(**case["layout"]), case["kv_dtype"],
                         case["model_revision"], case["rank"], case["world_size"],
                         bytes.fromhex(case["salt_hex"]))
    ns = namespace_id(spec)
    assert ns.hex() == case["namespace_hex"]
    assert [k.hex() for k in chunk_keys(ns, case["tokens"], case["chunk_tokens"])] == case["keys_hex"]
    assert [k.hex() for k in chunk_keys(ns, np.array(case["tokens"], dtype=np.int64),
                                        case["chunk_tokens"])] == case["keys_hex"]


def test_vectors_cover_partial_chunk_and_salt() -> None:
    assert any(len(c["tokens"]) % c["chunk_tokens"] for c in VECTORS)
    assert any(c["salt_hex"] for c in VECTORS)


LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=4)


def test_chain_depends_on_whole_prefix() -> None:
    ns = NamespaceSpec("m", LAY).namespace_id()
    a = chunk_keys(ns, list(range(12)), 4)
    b = chunk_keys(ns, [99] + list(range(1, 12)), 4)
    assert all(x != y for x, y in zip(a, b))  # one changed token invalidates everything after it
    c = chunk_keys(ns, list(range(8)) + [50, 51, 52, 53], 4)
    assert a[:2] == c[:2] and a[2] != c[2]


def test_every_namespace_field_matters() -> None:
    base = NamespaceSpec("m", LAY)
    variants = [
        NamespaceSpec("m2", LAY), NamespaceSpec("m", KVLayout(3, 2, 8, 4)),
        NamespaceSpec("m", KVLayout(2, 1, 8, 4)), NamespaceSpec("m", KVLayout(2, 2, 16, 4)),
        NamespaceSpec("m", KVLayout(2, 2, 8, 8)), NamespaceSpec("m", KVLayout(2, 2, 8, 4, kv=1)),
        NamespaceSpec("m", LAY, kv_dtype="bfloat16"), NamespaceSpec("m", LAY, model_revision="r"),
        NamespaceSpec("m", LAY, rank=1, world_size=2), NamespaceSpec("m", LAY, world_size=2),
        NamespaceSpec("m", LAY, salt=b"s"),
    ]
    ids = {namespace_id(v) for v in variants}
    assert len(ids) == len(variants) and namespace_id(base) not in ids


def test_length_prefix_prevents_field_concatenation_collisions() -> None:
    a = NamespaceSpec("ab", LAY, model_revision="c")
    b = NamespaceSpec("a", LAY, model_revision="bc")
    assert namespace_id(a) != namespace_id(b)


@pytest.mark.parametrize("hash_name", ["sha256", "xxh3_128", "blake3"])
def test_hash_options_give_32_byte_deterministic_keys(hash_name: str) -> None:
    spec = NamespaceSpec("m", LAY, hash_name=hash_name)  # type: ignore[arg-type]
    ns = namespace_id(spec)
    keys = chunk_keys(ns, list(range(10)), 4, hash_name)
    assert len(ns) == 32 and all(len(k) == 32 for k in keys) and len(set(keys)) == 3
    assert keys == chunk_keys(namespace_id(spec), list(range(10)), 4, hash_name)


def test_partial_chunk_and_spans() -> None:
    ns = NamespaceSpec("m", LAY).namespace_id()
    assert len(chunk_keys(ns, list(range(10)), 4)) == 3
    assert len(chunk_keys(ns, list(range(10)), 4, include_partial=False)) == 2
    assert chunk_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_spans(10, 4, include_partial=False) == [(0, 4), (4, 8)]


def test_tenant_salt_is_hmac_sha256() -> None:
    expect = hmac.new(b"k", b"t1", hashlib.sha256).digest()
    assert tenant_salt(b"k", "t1") == expect
    assert tenant_salt(b"k", "t2") != expect
    with pytest.raises(ValueError, match="secret"):
        tenant_salt(b"", "t1")


@pytest.mark.parametrize("bad", [[-1], [2**32], [[1, 2]], [1.5]])
def test_bad_tokens_are_refused(bad: list) -> None:
    with pytest.raises(ValueError):
        tokens_to_bytes(bad)


def test_bad_specs_name_the_field() -> None:
    with pytest.raises(ValueError, match="num_layers"):
        KVLayout(0, 1, 1)
    with pytest.raises(ValueError, match="rank"):
        NamespaceSpec("m", LAY, rank=2, world_size=2)
    with pytest.raises(ValueError, match="model_id"):
        NamespaceSpec("", LAY)


@pytest.mark.parametrize("tokens", [0, 1, 255, 256, 257, 1000, 131_072])
def test_c_chain_equals_the_python_chain(tokens: int) -> None:
    """The optional C loop (kvtier/_chain.c) gives the Python loop's keys byte for byte, for
    whole and partial chunks, from a numpy array or a list, at every chunk size."""
    import os

    from kvtier.keys import C_CHAIN_SHA256, chain_python, chunk_keys, tokens_to_bytes

    if C_CHAIN_SHA256 is None:
        # CI builds it (same machine image: gcc + OpenSSL headers); elsewhere it is optional.
        assert not os.environ.get("CI"), "kvtier._chain was not built: pip install -e . with a C compiler"
        pytest.skip("kvtier._chain not built here (optional accelerator)")
    ids = np.random.default_rng(tokens).integers(0, 2**32, tokens, dtype=np.uint64)
    raw = tokens_to_bytes(ids)
    ns = hashlib.sha256(b"ns").digest()
    for chunk in (1, 16, 256):
        step = 4 * chunk
        for end in (len(raw), len(raw) - len(raw) % step):
            assert C_CHAIN_SHA256(ns, raw, step, end) == chain_python(ns, raw, step, end)
        assert chunk_keys(ns, list(map(int, ids)), chunk) == chain_python(ns, raw, step, len(raw))
    with pytest.raises(ValueError, match="32 bytes"):
        C_CHAIN_SHA256(b"short", raw, 4, len(raw))
    with pytest.raises(ValueError, match="bad step"):
        C_CHAIN_SHA256(ns, raw, 0, len(raw))
    with pytest.raises(ValueError, match="bad step"):
        C_CHAIN_SHA256(ns, raw, 4, len(raw) + 1)
