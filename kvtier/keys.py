"""Versioned chunk keys: namespace + chained prefix hashes (schema ``kvtier/v1``).

The schema is documented in ``docs/keys.md`` and pinned by ``tests/vectors/keys_v1.json``;
every process, language and restart must produce the same bytes, so nothing random (no
PYTHONHASHSEED, no per-process seed) ever enters a key.

- Tokens are encoded as uint32 little-endian.
- ``namespace = H(field_0 ‖ field_1 ‖ ...)`` where each field is length-prefixed
  (uint32-LE byte count, then the bytes) so that no two field tuples collide by concatenation.
- ``key_0 = H(namespace ‖ tokens[0:C])``, ``key_i = H(key_{i-1} ‖ tokens[iC:(i+1)C])``.
  A trailing partial chunk is keyed the same way over its actual tokens.

Keys are 32 raw bytes internally; hex only at the edges (logs, JSON, Redis key names).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

SCHEMA = b"kvtier/v1"
KEY_BYTES = 32
HashName = Literal["sha256", "xxh3_128", "blake3"]
HASH_NAMES: tuple[str, ...] = ("sha256", "xxh3_128", "blake3")


@dataclass(frozen=True)
class KVLayout:
    """Shape of the K/V a model produces per token, and how many tokens make a chunk.

    ``kv`` is 2 for separate K and V (the usual case) and 1 for MLA-style latent caches.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_tokens: int = 256
    kv: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 1 << 20:
                raise ValueError(f"KVLayout.{name} must be an int in [1, 1048576], got {value!r}")
        if self.kv not in (1, 2):
            raise ValueError(f"KVLayout.kv must be 1 or 2, got {self.kv!r}")

    def chunk_shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        """(layers, kv, tokens, heads, head_dim): the canonical payload shape of a chunk."""
        return (self.num_layers, self.kv, tokens, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class NamespaceSpec:
    """Everything that must be equal for two engines' K/V bytes to be interchangeable."""

    model_id: str
    layout: KVLayout
    kv_dtype: str = "float16"
    model_revision: str = ""
    rank: int = 0
    world_size: int = 1
    salt: bytes = b""
    hash_name: HashName = "sha256"

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("NamespaceSpec.model_id must be a non-empty string")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"NamespaceSpec.rank must be in [0, world_size={self.world_size}), got {self.rank}"
            )
        if self.hash_name not in HASH_NAMES:
            raise ValueError(f"NamespaceSpec.hash_name must be one of {HASH_NAMES}, got {self.hash_name!r}")

    def namespace_id(self) -> bytes:
        return namespace_id(self)


ChainFn = Callable[[bytes, "bytes | memoryview", int, int], list[bytes]]


def _load_c_chain() -> ChainFn | None:
    """The optional C loop of the sha256 chain (kvtier/_chain.c): the same keys, without the
    per-chunk interpreter work. None where it was not built."""
    try:
        from kvtier._chain import chain_sha256
    except ImportError:
        return None
    return chain_sha256


C_CHAIN_SHA256 = _load_c_chain()


def _hasher(hash_name: str) -> Callable[[bytes], bytes]:
    if hash_name == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    if hash_name == "xxh3_128":
        import xxhash

        # xxh3-128 gives 16 bytes; two seeds make the 32-byte key width every tier expects.
        return lambda data: (
            xxhash.xxh3_128_digest(data, seed=0) + xxhash.xxh3_128_digest(data, seed=1)
        )
    if hash_name == "blake3":
        try:
            import blake3
        except ImportError as exc:  # optional dependency
            raise ImportError("hash 'blake3' needs the blake3 package: pip install kvtier[blake3]") from exc
        return lambda data: blake3.blake3(data).digest()
    raise ValueError(f"unknown hash {hash_name!r}; expected one of {HASH_NAMES}")


def _field(value: bytes) -> bytes:
    return struct.pack("<I", len(value)) + value


def namespace_fields(spec: NamespaceSpec) -> list[bytes]:
    """The ordered, length-prefixed fields hashed into the namespace (see docs/keys.md)."""
    lay = spec.layout
    ints = struct.pack(
        "<7I", lay.num_layers, lay.kv, lay.num_kv_heads, lay.head_dim, lay.chunk_tokens,
        spec.rank, spec.world_size,
    )
    return [
        _field(SCHEMA),
        _field(spec.model_id.encode()),
        _field(spec.model_revision.encode()),
        _field(spec.kv_dtype.encode()),
        _field(ints),
        _field(spec.salt),
    ]


def namespace_id(spec: NamespaceSpec) -> bytes:
    """32-byte namespace id; keys from different namespaces never collide."""
    return _hasher(spec.hash_name)(b"".join(namespace_fields(spec)))


def _token_view(tokens: Sequence[int] | np.ndarray) -> memoryview:
    """The uint32 little-endian encoding as a byte view (no copy when ``tokens`` already is a
    contiguous little-endian uint32 array); raises ValueError on ids outside [0, 2**32)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype != np.dtype("<u4"):
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
        if arr.min() < 0 or arr.max() > 0xFFFFFFFF:
            raise ValueError("token ids must be in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype="<u4").data.cast("B")


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """uint32 little-endian encoding; raises ValueError on ids outside [0, 2**32)."""
    return _token_view(tokens).tobytes()


def chunk_keys(
    namespace: bytes,
    tokens: Sequence[int] | np.ndarray,
    chunk_tokens: int,
    hash_name: str = "sha256",
    include_partial: bool = True,
) -> list[bytes]:
    """Chained keys of every chunk of ``tokens``; the last one covers a partial chunk if any."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if len(namespace) != KEY_BYTES:
        raise ValueError(f"namespace must be {KEY_BYTES} bytes, got {len(namespace)}")
    raw = _token_view(tokens)
    step = 4 * chunk_tokens
    end = len(raw) if include_partial else len(raw) - len(raw) % step
    if hash_name == "sha256" and C_CHAIN_SHA256 is not None:
        return C_CHAIN_SHA256(namespace, raw, step, end)
    return chain_python(namespace, raw, step, end, hash_name)


def chain_python(namespace: bytes, raw: bytes | memoryview, step: int, end: int, hash_name: str = "sha256") -> list[bytes]:
    """The chain over ``raw[:end]`` in ``step``-byte pieces, in Python (any hash); the C loop
    must agree with it byte for byte (tests/test_keys.py)."""
    h = _hasher(hash_name)
    keys: list[bytes] = []
    prev = namespace
    for off in range(0, end, step):
        prev = h(prev + raw[off : off + step])
        keys.append(prev)
    return keys


def chunk_spans(num_tokens: int, chunk_tokens: int, include_partial: bool = True) -> list[tuple[int, int]]:
    """[start, end) token span of each chunk key ``chunk_keys`` returns for ``num_tokens``."""
    end = num_tokens if include_partial else num_tokens - num_tokens % chunk_tokens
    return [(s, min(s + chunk_tokens, end)) for s in range(0, end, chunk_tokens)]


def tenant_salt(server_secret: bytes, tenant_id: str) -> bytes:
    """Per-tenant salt: HMAC-SHA256(server secret, tenant id). Empty secret is refused."""
    if not server_secret:
        raise ValueError("tenant_salt needs a non-empty server secret")
    return hmac.new(server_secret, tenant_id.encode(), hashlib.sha256).digest()


# --- Cross-engine keys: schema ``kvtier/x1`` (docs/sglang.md, tests/vectors/keys_x1.json) ------
# Engines that never hand a storage backend their tokens (SGLang's HiCache passes only its own
# SHA-256 page-hash chain) cannot compute the token chain above. The x1 schema keys one page of
# ``P = chunk_tokens`` tokens by that engine-neutral page chain instead, inside kvtier's
# namespace, so any engine that holds either the tokens or the page chain finds the same chunk.

XENGINE_SCHEMA = b"kvtier/x1"
PAGE_SEED_TAG = b"sglang-cache-namespace-v1"


def page_hash_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """Seed of a request's page chain, or None for the shared (unseeded) chain.

    ``SHA-256("sglang-cache-namespace-v1" ‖ part(extra_key) ‖ part(cache_salt))`` where
    ``part(None) = 0x00`` and ``part(s) = 0x01 ‖ uint64_le(len(utf8(s))) ‖ utf8(s)``: the same
    bytes as SGLang's ``storage_namespace_seed`` (LoRA ``extra_key``, tenant ``cache_salt``),
    so tenants with different salts never share a page chain. An empty ``cache_salt`` is no
    salt (None), as in SGLang's ``RadixKey``; an empty ``extra_key`` is a distinct namespace.
    """
    cache_salt = cache_salt or None
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(PAGE_SEED_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
        else:
            raw = part.encode()
            digest.update(b"\x01" + struct.pack("<Q", len(raw)) + raw)
    return digest.digest()


def page_hashes(tokens: Sequence[int] | np.ndarray, page_tokens: int, seed: bytes | None = None,
                include_partial: bool = False) -> list[bytes]:
    """The engine-neutral page chain: ``p_0 = SHA-256([seed ‖] u32le(tokens[0:P]))``,
    ``p_i = SHA-256(p_{i-1} ‖ u32le(tokens[iP:(i+1)P]))`` (SGLang's ``get_storage_hash_str``
    for token ids below 2**32). Always SHA-256, whatever the namespace's hash."""
    if page_tokens < 1:
        raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
    if seed is not None and len(seed) != KEY_BYTES:
        raise ValueError(f"seed must be {KEY_BYTES} bytes, got {len(seed)}")
    raw = tokens_to_bytes(tokens)
    step = 4 * page_tokens
    end = len(raw) if include_partial else len(raw) - len(raw) % step
    out: list[bytes] = []
    prev = seed or b""
    for off in range(0, end, step):
        prev = hashlib.sha256(prev + raw[off : off + step]).digest()
        out.append(prev)
    return out


def xengine_key(namespace: bytes, page_hash: bytes) -> bytes:
    """Key of the page whose chain hash is ``page_hash``:
    ``SHA-256(field("kvtier/x1") ‖ namespace ‖ page_hash)`` (namespace: ``namespace_id`` of a
    spec whose ``chunk_tokens`` is the page size)."""
    if len(namespace) != KEY_BYTES or len(page_hash) != KEY_BYTES:
        raise ValueError(f"namespace and page_hash must be {KEY_BYTES} bytes each")
    return hashlib.sha256(_field(XENGINE_SCHEMA) + namespace + page_hash).digest()


def xengine_keys(namespace: bytes, tokens: Sequence[int] | np.ndarray, page_tokens: int,
                 seed: bytes | None = None) -> list[bytes]:
    """x1 keys of every full page of ``tokens`` (what an engine holding tokens computes)."""
    return [xengine_key(namespace, p) for p in page_hashes(tokens, page_tokens, seed)]
