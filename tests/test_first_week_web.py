"""The live page (`genq monitor --web`) before its data comes: it says it is loading, in a real
headless Chromium, instead of bare axes and empty cards."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import free_port, genq_cmd, run_genq, wait_http, write_prompts
from tests.test_web import browser, wait_js  # noqa: F401  (the fixture: a real headless Chromium)

# What each chart's box shows over it (its ::after), and whether a uPlot canvas is drawn.
CHART_STATES = """() => Array.from(document.querySelectorAll('.chart')).map((el) => ({
    id: el.id, says: getComputedStyle(el, '::after').content, canvas: !!el.querySelector('canvas')}))"""


def test_the_page_says_loading_until_its_data_comes(tmp_path: Path, redis_url, procs, browser) -> None:  # noqa: F811
    write_prompts(tmp_path / "p.jsonl", 40)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "webload", "--output", str(tmp_path / "out"),
             redis_url=redis_url)
    port = free_port()
    procs(genq_cmd("monitor", "--web", f"127.0.0.1:{port}", "--interval", "0.5", redis_url=redis_url), name="monitor")
    base = f"http://127.0.0.1:{port}/"
    wait_http(base)
    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    held: list[object] = []
    page.route("**/api/state*", lambda route: held.append(route))  # the data does not come yet
    page.goto(base)
    wait_js(page, "document.readyState === 'complete'")
    page.wait_for_timeout(500)
    assert held, "the page asked for its data"
    assert page.locator("#status").text_content() == "loading…"
    assert page.locator("#loading").is_visible() and "Loading" in (page.locator("#loading").text_content() or "")
    charts = page.evaluate(CHART_STATES)
    assert len(charts) == 6 and all(c["says"] == '"loading…"' and not c["canvas"] for c in charts), charts

    page.unroute("**/api/state*")  # and the request it held goes on
    wait_js(page, "Number(document.body.dataset.polls || 0) >= 1", timeout=20_000)
    assert page.locator("#loading").is_hidden()
    assert page.locator("#status").text_content() == "queued"
    # A chart with fewer than two points says it waits for data; one with more draws, uncovered.
    for c in page.evaluate(CHART_STATES):
        assert c["canvas"] and c["says"] in ('"waiting for data"', "none"), c
