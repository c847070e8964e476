"""kvtier_sglang.pages, the page copies themselves (no SGLang needed): for every host layout
(MHA and MLA) and a few geometries, the C loop's gather/scatter (kvtier.strided, streaming
stores) moves exactly what torch's strided copy of the canonical view moves, the digest it
returns is xxh3 of the canonical bytes, and a load writes the page and nothing else. The
round trips through SGLang's real classes are in tests/sglang_checks/check_backend.py; this
catches a gather and a scatter wrong in matching ways, which a round trip cannot see."""

from __future__ import annotations

import pytest
import torch
import xxhash
from kvtier_sglang.pages import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    PageGeometry,
    load_page,
    page_view,
    save_page_hashed,
)

from kvtier import strided

CASES = [(layout, False) for layout in MHA_LAYOUTS] + [(layout, True) for layout in MLA_LAYOUTS]
SHAPES = [(2, 4, 16, 8, torch.bfloat16), (3, 1, 8, 4, torch.float32), (1, 2, 64, 1, torch.float16)]


@pytest.fixture(params=[pytest.param(True, id="c-loop", marks=pytest.mark.skipif(
    not strided.accelerated(), reason="kvtier._stream not built")), pytest.param(False, id="torch")])
def c_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if not request.param:
        monkeypatch.setattr(strided, "_STREAM", None)
        monkeypatch.setattr("kvtier_sglang.pages.accelerated", lambda: False)
    return bool(request.param)


@pytest.mark.parametrize(("layout", "mla"), CASES, ids=[f"{'mla' if m else 'mha'}-{lay}" for lay, m in CASES])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])))
def test_page_copies_match_torchs_canonical_view(c_loop: bool, layout: str, mla: bool, shape: tuple) -> None:
    layers, heads, head_dim, page, dtype = shape
    geo = PageGeometry(layout=layout, is_mla=mla, layers=layers, heads=1 if mla else heads,
                       head_dim=head_dim, page_tokens=page, dtype=dtype)
    slots = 5 * page
    gen = torch.Generator().manual_seed(layers * 100 + head_dim)
    pool = torch.randn(geo.buffer_dims(slots), generator=gen).to(dtype)
    for slot in (0, 2 * page, 4 * page):
        view = page_view(geo, pool, slot)
        want = view.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        out = bytearray(geo.page_bytes)
        assert save_page_hashed(view, out) == xxhash.xxh3_64_intdigest(want)
        assert bytes(out) == want
        other = torch.zeros_like(pool)
        load_page(page_view(geo, other, slot), out)
        expect = torch.zeros_like(pool)
        page_view(geo, expect, slot).copy_(view)
        assert torch.equal(other.view(torch.uint8), expect.view(torch.uint8))  # the page, nothing else
