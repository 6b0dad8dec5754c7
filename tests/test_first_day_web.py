"""The first day on a real fleet (#28): the web page, in a real headless Chromium, against a real run.

Seen by a user: without ?job= the page opened the alphabetically first (finished) job while
another ran; api/state?job=nosuch answered 200 with another job's data; y-axis labels lost
their leading digit (15,000 as "5,000"); "How the ETA moved" was flattened by its first
point; the fleet line was drawn from another window than the per-GPU lines; no per-worker
table.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

from tests.conftest import free_port, genq_cmd, run_genq, wait_http, write_prompts
from tests.test_web import browser, wait_js  # noqa: F401  (the fixture)

SLOW = dict(step_ms_base=30, step_ms_per_req=0, tokens_per_step=8, mean_output_tokens=150, output_sigma=0.8,
            max_running_requests=4)
FAST = dict(step_ms_base=2, step_ms_per_req=0, tokens_per_step=16, mean_output_tokens=32, output_sigma=0.5)

# Each y axis: its labels as drawn, the widest one measured in the axis font, and the axis' width.
AXES = """() => Object.fromEntries(Object.entries(charts).map(([id, c]) => {
    const u = c.plot, ax = u.axes[1];
    u.ctx.font = ax.font[0];
    const widest = Math.max(0, ...(ax._values || []).map((v) => u.ctx.measureText(String(v)).width));
    return [id, {labels: ax._values, widest: widest, room: ax._size / devicePixelRatio - 2 * ax.gap - ax.ticks.size}];
}))"""


def _state(base: str, job: str | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(base + "api/state" + (f"?job={job}" if job else ""), timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_page_follows_the_running_job_and_draws_true_figures(tmp_path: Path, redis_url, sim, worker, procs,
                                                                 browser) -> None:  # noqa: F811
    # A finished job first in the alphabet, and a running one after it.
    write_prompts(tmp_path / "a.jsonl", 20)
    run_genq("enqueue", str(tmp_path / "a.jsonl"), "--job", "aaa-finished", "--output", str(tmp_path / "out"))
    assert worker(sim(**FAST), "--burst", "--name", "first").wait(90) == 0
    write_prompts(tmp_path / "z.jsonl", 400)
    run_genq("enqueue", str(tmp_path / "z.jsonl"), "--job", "zzz-running", "--output", str(tmp_path / "out"),
             "--batch-size", "20", "--max-tokens", "400")
    port = free_port()
    procs(genq_cmd("monitor", "--web", f"127.0.0.1:{port}", "--json", "--interval", "0.5"), name="monitor")
    base = f"http://127.0.0.1:{port}/"
    wait_http(base)
    worker(sim(**SLOW), "--name", "gpu0")

    status, body = _state(base, "nosuch")
    assert status == 404 and "nosuch" in body["error"] and body["jobs"] == ["aaa-finished", "zzz-running"], body

    page = browser.new_page(viewport={"width": 1500, "height": 1600})
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto(base)
    wait_js(page, "document.getElementById('status').textContent === 'running'", timeout=60_000)
    assert page.locator("#job-picker").input_value() == "zzz-running"
    # Enough history for the charts, then the per-worker table and the fleet line.
    wait_js(page, "charts['chart-tok'].plot.data[0].length >= 8 && "
                           "charts['chart-tok'].plot.data[2].filter((v) => v > 0).length >= 4", timeout=60_000)
    row = page.locator("#workers tr[data-worker=gpu0] td")
    assert row.nth(1).text_content() == "busy" and int(row.nth(4).get_attribute("data-value")) >= 0
    assert page.locator("#workers tr[data-worker=first]").count() == 0  # another job's worker: not here
    page.evaluate("clearTimeout(timer); timer = null; interval = 3600")  # hold the page still
    fleet, gpu = page.evaluate("[charts['chart-tok'].plot.data[1], charts['chart-tok'].plot.data[2]]")
    pairs = [(f, g) for f, g in zip(fleet, gpu) if g is not None]
    assert pairs and all(f == g for f, g in pairs), pairs  # one GPU: the fleet is that GPU's line

    # Large figures: every y label fits its axis (the leading digit was cut).
    page.evaluate("""() => fetch('api/state?job=zzz-running').then((r) => r.json()).then((s) => {
        for (const w of Object.values(s.history.workers)) {
            w.tok_per_s = w.tok_per_s.map((v) => v === null ? null : v * 1000 + 15000);
            w.req_per_s = w.req_per_s.map((v) => v === null ? null : v * 1000 + 15000);
        }
        window.big = s; render(s);
    })""")
    for chart, axis in page.evaluate(AXES).items():
        assert axis["widest"] <= axis["room"] + 0.5, (chart, axis)

    # A first ETA far above the rest does not set the chart's top.
    page.evaluate("""() => { const h = window.big.history, n = h.t.length;
        h.eta_s = h.t.map((_, i) => i === 0 ? 100000 : 600 - i);
        h.eta_low_s = h.eta_s.map((v) => v * 0.8); h.eta_high_s = h.eta_s.map((v) => v * 1.2);
        render(window.big); }""")
    top = page.evaluate("charts['chart-eta'].plot.scales.y.max")
    assert top < 2000, top

    page.evaluate("interval = 0.5; poll()")
    # The screenshot (docs/monitor-web.png): the run well under way, its ETA with a history.
    wait_js(page, "charts['chart-eta'].plot.data[1].filter((v) => v !== null).length >= 10 && "
                           "Number(document.getElementById('completed').dataset.value) >= 120", timeout=120_000)
    shot = tmp_path / "monitor-web.png"
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("GENQ_WEB_SCREENSHOT"):  # GENQ_WEB_SCREENSHOT=docs/monitor-web.png pytest ...
        shutil.copy(shot, os.environ["GENQ_WEB_SCREENSHOT"])
    assert problems == [], problems


def test_an_unknown_job_is_a_404_and_the_page_says_so(tmp_path: Path, redis_url, procs, browser) -> None:  # noqa: F811
    write_prompts(tmp_path / "p.jsonl", 3)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "only")
    port = free_port()
    procs(genq_cmd("monitor", "--web", f"127.0.0.1:{port}", "--interval", "0.5"), name="monitor")
    base = f"http://127.0.0.1:{port}/"
    wait_http(base)
    assert _state(base)[1]["job"] == "only"
    page = browser.new_page()
    page.goto(base + "?job=nosuch")
    wait_js(page, "document.getElementById('error').textContent.includes('nosuch')", timeout=20_000)
    assert page.locator("#job-picker option").all_text_contents() == ["only"]
    assert page.locator("#elapsed").text_content() in ("", None)  # nothing of another job was drawn


def test_a_finished_job_without_times_is_not_said_not_started(tmp_path: Path, redis_url, rconn, procs,
                                                              browser) -> None:  # noqa: F811
    """`genq recover` rebuilds the workers' counts but not when they sent: a finished job with no elapsed time
    is not "not started" on the page (as in the terminal, tests/test_first_day_figures.py)."""
    from genq.core import keys

    write_prompts(tmp_path / "p.jsonl", 3)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "rebuilt", "--output", str(tmp_path / "out"))
    rconn.sadd(keys.job_workers("rebuilt"), "w")
    rconn.hset(keys.worker_stats("rebuilt", "w"), mapping={"done": 3, "failed": 0, "in_tok": 3, "out_tok": 30})
    port = free_port()
    procs(genq_cmd("monitor", "--web", f"127.0.0.1:{port}", "--interval", "0.5"), name="monitor")
    base = f"http://127.0.0.1:{port}/"
    wait_http(base)
    page = browser.new_page()
    page.goto(base)
    wait_js(page, "document.getElementById('completed').dataset.value === '3'", timeout=20_000)
    assert page.locator("#elapsed").get_attribute("data-value") == "0"
    assert page.locator("#elapsed").text_content() != "not started"
