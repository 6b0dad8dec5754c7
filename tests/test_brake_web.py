"""A blocked job on `genq monitor --web` (#25): the live page in a real headless Chromium says why."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import free_port, genq_cmd, run_genq, wait_http, write_prompts
from tests.test_web import browser, wait_js  # noqa: F401  (the fixture: a real headless Chromium)


def test_the_page_says_why_a_job_is_blocked(tmp_path: Path, redis_url, sim, worker, procs, browser) -> None:  # noqa: F811
    url = sim(max_context=2048, step_ms_base=2)
    write_prompts(tmp_path / "p.jsonl", 40)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "webblk", "--output", str(tmp_path / "out"),
             "--max-tokens", "4096", redis_url=redis_url)
    assert worker(url, "--burst").wait(60) == 0
    port = free_port()
    procs(genq_cmd("monitor", "--web", f"127.0.0.1:{port}", "--interval", "0.5", redis_url=redis_url), name="monitor")
    base = f"http://127.0.0.1:{port}/"
    wait_http(base)
    page = browser.new_page()
    page.goto(base)
    wait_js(page, "document.getElementById('status').textContent === 'blocked'", timeout=30_000)
    line = page.locator("#blocked")
    assert line.is_visible()
    text = line.text_content() or ""
    assert "job webblk is blocked (preflight" in text and "max_tokens 4096" in text, text
    assert "genq resume --job webblk" in text, text
