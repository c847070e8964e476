"""Host pools whose bytes do not say everything about their pages: fp8 KV (SGLang keeps e4m3
and e5m2 alike in uint8 buffers) must not share a namespace, and a pool that keeps part of a
page outside ``kv_buffer`` (SGLang's MXFP8 scales) is refused. Runs in the SGLang venv only
(started by tests/test_sglang.py), on SGLang's real pools and backend factory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from check_backend import PAGE, keys_for, make
from pools import mha_pools

from kvtier.errors import ConfigError


def test_fp8_formats_never_share_pages(tmp_path: Path) -> None:
    """SGLang keeps fp8 KV, e4m3 and e5m2 alike, in uint8 buffers: the host pool cannot tell
    them apart, and an e5m2 instance once restored e4m3 pages as its own. Without a dtype
    named (sglang.kv_dtype, or the server's --kv-cache-dtype) the attach is refused; with the
    formats named, they see nothing of each other, and the same format sees everything."""
    disk = {"cpu": {"enabled": False}, "disk": {"enabled": True, "path": str(tmp_path)}}
    _, host_w = mha_pools("page_first", dtype=torch.float8_e4m3fn)
    assert host_w.kv_buffer.dtype == torch.uint8  # the premise: the pool says uint8
    with pytest.raises(ConfigError, match="sglang.kv_dtype"):
        make(host_w, "page_first", disk)
    with pytest.raises(ConfigError, match="sglang.kv_dtype"):
        make(mha_pools("page_first")[1], "page_first", {**disk, "sglang": {"kv_dtype": "float8_e5m2"}})
    tokens = list(range(80, 80 + 3 * PAGE))
    writer = make(host_w, "page_first", {**disk, "sglang": {"kv_dtype": "float8_e4m3fn"}})
    src = host_w.alloc(3 * PAGE)
    host_w.kv_buffer.view(torch.uint8).copy_(torch.randint(0, 255, host_w.kv_buffer.shape, dtype=torch.uint8))
    assert all(writer.batch_set_v1(keys_for(tokens), src))
    other = make(mha_pools("page_first", dtype=torch.float8_e5m2)[1], "page_first",
                 {**disk, "sglang": {"kv_dtype": "float8_e5m2"}})
    same = make(mha_pools("page_first", dtype=torch.float8_e4m3fn)[1], "page_first",
                {**disk, "sglang": {"kv_dtype": "float8_e4m3fn"}})
    assert other.namespace != writer.namespace == same.namespace
    assert other.batch_exists(keys_for(tokens)) == 0
    assert same.batch_exists(keys_for(tokens)) == 3
    for be in (writer, other, same):
        be.close()


def test_a_pool_keeping_part_of_a_page_elsewhere_is_refused() -> None:
    """SGLang's MXFP8 host pool (it needs CUDA to build) keeps each page's scales outside
    kv_buffer and says so: its storage page accessors raise NotImplementedError. kvtier stored
    kv_buffer alone and restored pages with stale scales; it now refuses the pool at attach.
    Here a real MHA pool whose accessor raises as the MXFP8 one does."""
    _, host = mha_pools("page_first")

    class ScalesElsewhere(type(host)):  # type: ignore[misc]
        def get_page_buffer_meta(self, indices: Any) -> Any:
            raise NotImplementedError("a page's UE8M0 scales live outside kv_buffer")

    host.__class__ = ScalesElsewhere
    with pytest.raises(ValueError, match="scales live outside kv_buffer"):
        make(host, "page_first")
