"""Cross-engine key schema ``kvtier/x1`` (docs/sglang.md), pinned by tests/vectors/keys_x1.json.

The vectors are recomputed here with plain hashlib/struct from the rules in docs/sglang.md, so a
change to kvtier.keys that changes any byte fails. (That the page chain is SGLang's own
``get_storage_hash_str`` is checked against SGLang itself in tests/sglang_checks/check_backend.py.)
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from kvtier.keys import (
    KVLayout,
    NamespaceSpec,
    chunk_keys,
    namespace_id,
    page_hash_seed,
    page_hashes,
    xengine_key,
    xengine_keys,
)

VECTORS = json.loads((Path(__file__).parent / "vectors" / "keys_x1.json").read_text())


def _field(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def _plain_namespace(case: dict[str, Any]) -> bytes:
    lay = case["layout"]
    ints = struct.pack("<7I", lay["num_layers"], lay["kv"], lay["num_kv_heads"], lay["head_dim"],
                       lay["chunk_tokens"], case["rank"], case["world_size"])
    fields = [b"kvtier/v1", case["model_id"].encode(), case["model_revision"].encode(),
              case["kv_dtype"].encode(), ints, bytes.fromhex(case["salt_hex"])]
    return hashlib.sha256(b"".join(_field(f) for f in fields)).digest()


def _plain_seed(extra_key: str | None, cache_salt: str | None) -> bytes:
    cache_salt = cache_salt or None  # empty salt = no salt (docs/sglang.md)
    if extra_key is None and cache_salt is None:
        return b""
    h = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        h.update(b"\x00" if part is None else b"\x01" + struct.pack("<Q", len(part.encode())) + part.encode())
    return h.digest()


@pytest.mark.parametrize("case", VECTORS, ids=[c["model_id"] for c in VECTORS])
def test_x1_vectors_recomputed_with_plain_hashlib(case: dict[str, Any]) -> None:
    ns = _plain_namespace(case)
    assert ns.hex() == case["namespace_hex"]
    seed = _plain_seed(case["extra_key"], case["cache_salt"])
    assert seed.hex() == case["seed_hex"]
    page, toks = case["layout"]["chunk_tokens"], case["tokens"]
    prev, pages = seed, []
    for i in range(len(toks) // page):
        prev = hashlib.sha256(prev + struct.pack(f"<{page}I", *toks[i * page:(i + 1) * page])).digest()
        pages.append(prev)
    assert [p.hex() for p in pages] == case["page_hashes_hex"]
    keys = [hashlib.sha256(_field(b"kvtier/x1") + ns + p).digest() for p in pages]
    assert [k.hex() for k in keys] == case["keys_hex"]


@pytest.mark.parametrize("case", VECTORS, ids=[c["model_id"] for c in VECTORS])
def test_library_matches_x1_vectors(case: dict[str, Any]) -> None:
    spec = NamespaceSpec(case["model_id"], KVLayout(**case["layout"]), case["kv_dtype"],
                         case["model_revision"], case["rank"], case["world_size"],
                         bytes.fromhex(case["salt_hex"]))
    ns = namespace_id(spec)
    seed = page_hash_seed(case["extra_key"], case["cache_salt"])
    page = spec.layout.chunk_tokens
    assert [p.hex() for p in page_hashes(case["tokens"], page, seed)] == case["page_hashes_hex"]
    assert [k.hex() for k in xengine_keys(ns, case["tokens"], page, seed)] == case["keys_hex"]


def test_x1_keys_never_collide_with_v1_keys_or_across_tenants() -> None:
    spec = NamespaceSpec("m", KVLayout(2, 2, 8, chunk_tokens=4))
    ns, toks = namespace_id(spec), list(range(16))
    v1, x1 = set(chunk_keys(ns, toks, 4)), xengine_keys(ns, toks, 4)
    assert not v1 & set(x1)
    salted = xengine_keys(ns, toks, 4, page_hash_seed(None, "tenant-a"))
    assert not set(salted) & set(x1)
    assert page_hash_seed("", None) not in (None, page_hash_seed(None, "x"))
    assert page_hash_seed(None, "") is None          # an empty cache_salt is no salt, as in SGLang


def test_x1_rejects_bad_input_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="page_tokens"):
        page_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="seed"):
        page_hashes([1, 2], 1, seed=b"short")
    with pytest.raises(ValueError, match="32 bytes"):
        xengine_key(b"x", b"y" * 32)
    with pytest.raises(ValueError, match="token ids"):
        page_hashes([-1], 1)
