"""The HTML report, opened by a real headless Chromium (Playwright driving /usr/bin/chromium):
every plot decodes to a real image, the breakers are listed, nothing is fetched from the
network, and a PNG screenshot is saved next to the report."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.analyze import synth

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason="chromium not installed (scripts/test.sh installs it: apt-get install chromium)")


def test_report_opens_in_headless_chromium_and_plots_render(tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    tok = synth.build_tokenizer(tmp_path / "tok")
    log = synth.write_text_log(tmp_path / "log.jsonl", "timestamp", 120)
    report = tmp_path / "report.html"
    prices = Path(__file__).resolve().parents[1] / "kvtier" / "analyze" / "prices" / "example-hosted-api.yaml"
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "analyze", str(log), "--tokenizer", str(tok),
                        "--html", str(report), "--prices", str(prices), "-q"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    page_text = report.read_text()
    assert "http://" not in page_text and "https://" not in page_text  # self-contained: no CDN
    requests: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.on("request", lambda req: requests.append(req.url))
            page.goto(report.as_uri())
            page.wait_for_load_state("load")
            images = page.evaluate("Array.from(document.images).map(i => "
                                   "({alt: i.alt, ok: i.complete, w: i.naturalWidth, h: i.naturalHeight}))")
            kinds = page.locator("span.kind").all_inner_texts()
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        finally:
            browser.close()
    assert [i["alt"] for i in images] == ["hit ratio by capacity", "savings by capacity", "hit ratio by TTL", "breakers"]
    assert all(i["ok"] and i["w"] > 300 and i["h"] > 100 for i in images), images
    assert kinds == ["timestamp"]
    assert all(u.startswith(("file:", "data:")) for u in requests), requests
    assert (tmp_path / "report.png").stat().st_size > 10_000
