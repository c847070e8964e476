"""/dashboard in a real headless Chromium (Playwright driving /usr/bin/chromium) over a live
2-node cluster with real engines (kvtier_hf replicas) reporting under load: the figures shown
equal /api/cluster, a killed node shows as down within 5 s, hostile node and replica names
render as text (no script of theirs runs), and screenshots are saved as artifacts.

``KVTIER_UPDATE_SCREENSHOT=1`` also rewrites docs/img/dashboard.png (friendly names, a longer
load so that the chart has history, and the ``kvtier demo`` model with 512-token prefixes in
1 MiB chunks, so that the TTFT card shows what a cache is for: with the test's tiny model a
prefill costs less than a round trip); CI runs never touch the committed copy.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("no chromium (apt-get install chromium)", allow_module_level=True)

from kvtier_hf import KVTierHF  # noqa: E402
from kvtier_hf.random_llama import DEMO_SPEC, TEST_SPEC, build_random_llama, random_prompt  # noqa: E402

from kvtier.config import KVTierConfig  # noqa: E402
from tests.kvtier_servers import ROOT, ServerProc, start_server  # noqa: E402
from tests.redis_servers import free_port  # noqa: E402
from tests.test_usage_e2e import get_json  # noqa: E402

UPDATE = os.environ.get("KVTIER_UPDATE_SCREENSHOT") == "1"
HOSTILE_NODE = '<img src=x onerror="window.__pwned=1">node-b'
HOSTILE_REPLICA = "<script>window.__pwned=2</script>replica"
INTERVAL = 0.5
BUCKET_S = 2.0 if not UPDATE else 5.0
LOAD_S = 10.0 if not UPDATE else 120.0
# Model sizes, shared prefix and chunk length (tokens), and the two nodes' RAM bounds.
SPEC = TEST_SPEC if not UPDATE else DEMO_SPEC
PREFIX_TOKENS, CHUNK_TOKENS = (96, 16) if not UPDATE else (512, 64)
NODE_A_RAM = ("--disk-bytes", "64MiB") if not UPDATE else ("--disk-bytes", "256MiB", "--slot-bytes", "1100KiB")
NODE_B_RAM = ("--cpu-bytes", "2MiB", "--slot-bytes", "64KiB") if not UPDATE else ("--cpu-bytes", "48MiB", "--slot-bytes", "1100KiB")


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[list[ServerProc]]:
    ha, hb = free_port(), free_port()
    peers = f"127.0.0.1:{ha},127.0.0.1:{hb}"
    names = ("node-a", "node-b") if UPDATE else ("node-a", HOSTILE_NODE)
    nodes: list[ServerProc] = []
    try:
        for name, port, extra in ((names[0], ha, ("--disk-dir", "disk", *NODE_A_RAM)),
                                  (names[1], hb, NODE_B_RAM)):
            nodes.append(start_server(tmp_path / f"n{port}", "--node-id", name, "--peers", peers, *extra,
                                      "--set", f"usage_bucket_s={BUCKET_S}", name=f"n{port}",
                                      ports=("--port", "0", "--http-port", str(port), "--data-port", "0")))
        yield nodes
    finally:
        for s in nodes:
            s.kill()


class Load:
    """Replicas of two models sending prompts that share a few long prefixes (hits) among
    fresh ones (misses), in a background thread, until paused."""

    def __init__(self, nodes: list[ServerProc]) -> None:
        models = [build_random_llama(SPEC), build_random_llama(replace(SPEC, seed=1))]
        replicas = [("vllm-0", 0, "llama-3-8b-instruct"), ("vllm-1", 0, "llama-3-8b-instruct"),
                    ("vllm-2", 1, "qwen2.5-7b"), (HOSTILE_REPLICA if not UPDATE else "vllm-3", 1, "qwen2.5-7b")]
        self.engines = [KVTierHF(models[m], KVTierConfig.from_dict({
            "chunk_tokens": CHUNK_TOKENS, "cpu": {"enabled": False},
            "grpc": {"enabled": True, "nodes": [n.address for n in nodes], "timeout_s": 1.0,
                     "backoff_s": 0.05, "backoff_max_s": 0.5},
            "usage": {"interval_s": INTERVAL, "replica_id": rid}}), model_id=mid) for rid, m, mid in replicas]
        self.prefixes = [random_prompt(PREFIX_TOKENS, SPEC.vocab_size, 100 + i) for i in range(6)]
        self.rng = random.Random(5)
        self.running = threading.Event()
        self.idle = threading.Event()  # set by the thread between requests while paused
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                if not self.running.is_set():
                    self.idle.set()
                    self.running.wait(0.1)
                    continue
                self.idle.clear()
                hf = self.rng.choice(self.engines)
                suffix = random_prompt(self.rng.randint(8, 40), SPEC.vocab_size, self.rng.randint(0, 1 << 30))
                shared = self.rng.random() < 0.75
                ids = (self.rng.choice(self.prefixes) if shared else []) + suffix
                hf.generate(ids, 1)
        except BaseException as exc:  # surfaced by the test, not lost in the thread
            self.errors.append(exc)

    def pause(self) -> None:
        """Returns once no request is in flight (its counters are all recorded)."""
        self.idle.clear()
        self.running.clear()
        assert self.idle.wait(30), "the load did not pause"

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        for hf in self.engines:
            hf.close()


def wait_until(done: Any, timeout: float) -> None:
    """Polls from Python: the page's CSP (no eval) forbids Playwright's wait_for_function."""
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, f"not within {timeout}s"
        time.sleep(0.1)


def pct(r: float | None) -> str:
    return "\u2013" if r is None else f"{100 * r:.1f}%"


def test_dashboard_in_chromium_under_load(cluster: list[ServerProc], tmp_path: Path) -> None:
    a, b = cluster
    load = Load(cluster)
    load.thread.start()
    load.running.set()
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1440, "height": 1000}, color_scheme="dark")
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("requestfailed", lambda req: errors.append("request failed: " + req.url)
                    if not req.url.endswith("/api/cluster") else None)
            page.goto(a.http + "/dashboard")
            deadline = time.monotonic() + LOAD_S
            while time.monotonic() < deadline and not load.errors:
                time.sleep(0.5)
            assert not load.errors, load.errors

            # Quiesce: no new requests, every replica's last counters reported, page redrawn.
            load.pause()
            for hf in load.engines:
                assert hf.usage is not None and hf.usage.send_now(2.0) == 2
            api = get_json(a.http + "/api/cluster")
            rendered = int(page.get_attribute("body", "data-rendered") or 0)
            wait_until(lambda: int(page.get_attribute("body", "data-rendered") or 0) >= rendered + 2, 10.0)
            shown = page.evaluate("window.kvtierLast")
            check_figures(page, shown, api)

            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            print(f"screenshot: {tmp_path / 'dashboard.png'}")
            if UPDATE:
                (ROOT / "docs" / "img").mkdir(parents=True, exist_ok=True)
                shutil.copy(tmp_path / "dashboard.png", ROOT / "docs" / "img" / "dashboard.png")
            if not UPDATE:
                check_hostile_names_are_text(page)

            # A node dies mid-test: shown down within 5 s of the kill.
            load.running.set()
            b.kill()
            killed = time.monotonic()
            page.wait_for_selector("[data-node] .badge.down", timeout=5_000)
            assert time.monotonic() - killed < 5.0
            assert "1 node down" in page.text_content("#banner")
            down_name = page.text_content("[data-node].down .node-name")
            assert down_name == ("node-b" if UPDATE else HOSTILE_NODE)
            page.screenshot(path=str(tmp_path / "dashboard-node-down.png"), full_page=True)
            assert not errors, errors
            browser.close()
    finally:
        load.close()
    assert not load.errors, load.errors


def check_figures(page: Any, shown: dict[str, Any], api: dict[str, Any]) -> None:
    """What the page drew is the document /api/cluster serves, and its text says so."""
    e, s = api["engines"], shown["engines"]
    def timeless(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k != "age_s"} for r in rows]  # seconds since the last report

    def busy(series: list[list[Any]]) -> list[list[Any]]:
        return [pt for pt in series if pt[1]]  # empty buckets follow the clock

    assert s["totals"] == e["totals"] and busy(s["series"]) == busy(e["series"])
    assert timeless(s["replicas"]) == timeless(e["replicas"]) and timeless(s["models"]) == timeless(e["models"])
    assert e["totals"]["prompt_tokens"] > 0 and 0 < e["totals"]["hit_ratio"] < 1
    assert len(e["replicas"]) == 4 and {m["model"] for m in e["models"]} == {"llama-3-8b-instruct", "qwen2.5-7b"}
    assert all(r["nodes"] == sorted(n["node_id"] for n in api["nodes"]) for r in e["replicas"])
    assert page.text_content('[data-value="hit_ratio"]') == pct(e["totals"]["hit_ratio"])
    assert page.text_content('[data-value="replicas"]') == "4 reporting"
    assert page.text_content('[data-value="nodes"]') == "2 up"
    titles = page.locator("#replica-chart svg title").all_text_contents()
    assert sorted(t.split(": ")[0] for t in titles) == sorted(r["replica"] for r in e["replicas"])
    assert sum(p for _, p, _, _ in e["series"]) == e["totals"]["prompt_tokens"]
    tiers = page.locator("#tier-chart svg text").all_text_contents()
    assert set(e["totals"]["hits_per_tier"]) <= set(tiers)
    # The storage nodes' figures too (the load is paused and its only tier, grpc, is written
    # through: they no longer move), the chunk hit rate card as the lookups' ratio.
    t = api["totals"]
    assert shown["totals"] == t and shown["nodes_up"] == api["nodes_up"] == 2
    assert t["lookups"] > 0 and t["hit_rate"] == t["hit_chunks"] / (t["hit_chunks"] + t["miss_chunks"])
    assert t["capacity_bytes"] == sum(n["totals"]["capacity_bytes"] for n in api["nodes"])
    assert page.text_content('[data-value="chunk_hit_rate"]') == pct(t["hit_rate"])


def check_hostile_names_are_text(page: Any) -> None:
    assert page.evaluate("window.__pwned") is None
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.evaluate("document.scripts.length") == 1
    names = page.locator(".node-name").all_text_contents()
    assert HOSTILE_NODE in names
    assert any(HOSTILE_REPLICA in t for t in page.locator("#replica-chart svg title").all_text_contents())
