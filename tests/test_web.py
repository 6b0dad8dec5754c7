"""`genq monitor --web`: the live page in a real headless Chromium, against a real run."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from genq.core import keys
from tests.conftest import free_port, genq_cmd, run_genq, wait_http, wait_until

CHROMIUM = "/usr/bin/chromium"
SIM = dict(step_ms_base=30, step_ms_per_req=0, tokens_per_step=8, mean_output_tokens=150, output_sigma=0.8,
           max_running_requests=4, context_length=1024)
# Figures the page shows that `genq monitor --once --json` has too.
SAME = ("total", "completed", "failed", "percent", "percent_completed", "percent_failed", "rate_per_sec",
        "output_tokens_per_sec", "elapsed_s", "shards", "shard_records", "s3_bytes", "batches_done", "in_flight",
        "queued", "eta_s")
PAGE_IDS = {"total": "total", "completed": "completed", "failed": "failed", "percent": "percent",
            "percent_completed": "percent-completed", "percent_failed": "percent-failed", "rate_per_sec": "rate",
            "output_tokens_per_sec": "toks", "elapsed_s": "elapsed", "shards": "shards",
            "shard_records": "shard-records", "s3_bytes": "shard-bytes", "batches_done": "batches-done",
            "in_flight": "in-flight", "queued": "queued", "eta_s": "eta"}


def write_prompts_with_long(path: Path, n: int, long_every: int = 10) -> int:
    """n prompts; every long_every-th is longer than the sim's context (a bad_request dead letter)."""
    long = 0
    with open(path, "w") as f:
        for i in range(n):
            too_long = i % long_every == 3
            long += too_long
            content = ("y" * 8000 + f" {i}") if too_long else f"prompt number {i}"
            f.write(json.dumps({"id": f"p{i:05d}", "messages": [{"role": "user", "content": content}]}) + "\n")
    return long


@pytest.fixture
def browser():
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        pytest.fail("this test needs Chromium: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=shutil.which("chromium") or CHROMIUM, headless=True,
                               args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def wait_js(page, expression: str, timeout: float = 30_000, polling: float = 100) -> None:
    """page.wait_for_function, polled from here: Playwright's own evaluates the expression with eval
    inside the page, which the page's Content-Security-Policy (no 'unsafe-eval') refuses."""
    deadline = time.monotonic() + timeout / 1000
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout / 1000:.0f} s: {expression}")
        page.wait_for_timeout(polling)


def page_values(page) -> dict:
    return page.evaluate("""(ids) => Object.fromEntries(Object.entries(ids).map(
        ([k, id]) => [k, document.getElementById(id).dataset.value]))""", PAGE_IDS)


def as_number(text: str):
    return None if text in ("", None) else float(text)


# How many pixels of its series' colours each chart's canvas holds: > 0 means lines or bars were drawn
# (axes and grid are grey). Series may hide each other (two GPUs both at 100%), so any series counts.
DRAWN = """() => Object.fromEntries(Object.entries(charts).map(([id, c]) => {
    const u = c.plot;
    const wants = u.series.slice(1).map((s) => [1, 3, 5].map((i) => parseInt(s.stroke().slice(i, i + 2), 16)));
    const img = u.ctx.getImageData(0, 0, u.ctx.canvas.width, u.ctx.canvas.height).data;
    let n = 0;
    for (let i = 0; i < img.length; i += 4) {
        if (img[i + 3] > 200 && wants.some((w) => Math.abs(img[i] - w[0]) < 40 && Math.abs(img[i + 1] - w[1]) < 40
                                                  && Math.abs(img[i + 2] - w[2]) < 40)) n++;
    }
    return [id, n];
}))"""


def test_live_page_draws_the_run_and_agrees_with_once_json(tmp_path: Path, redis_url, rconn, sim, worker, procs,
                                                          browser) -> None:
    sims = [sim(**SIM), sim(**SIM)]
    n_long = write_prompts_with_long(tmp_path / "p.jsonl", 300)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "webjob", "--output", str(tmp_path / "out"),
             "--batch-size", "16", "--max-tokens", "600")
    port = free_port()
    mon = procs(genq_cmd("monitor", "--web", f"127.0.0.1:{port}", "--json", "--interval", "0.5"), name="monitor")
    base = f"http://127.0.0.1:{port}/"
    wait_http(base)
    assert "read-only" in wait_until(lambda: "live page" in mon.log() and mon.log(), 10, "the monitor's banner")

    html = urllib.request.urlopen(base, timeout=5).read().decode()
    assert not re.search(r"""(src|href)=["'](https?:)?//""", html), "the page must not load anything from outside"
    with urllib.request.urlopen(base + "static/uPlot.iife.min.js", timeout=5) as resp:
        assert resp.status == 200 and b"uPlot" in resp.read()
    with pytest.raises(urllib.error.HTTPError) as err:  # read-only by default
        urllib.request.urlopen(urllib.request.Request(base + "api/control", data=b"{}", method="POST"), timeout=5)
    assert err.value.code in (404, 405)

    page = browser.new_page(viewport={"width": 1500, "height": 1500})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto(base)
    wait_js(page, "Number(document.body.dataset.polls || 0) >= 1")
    assert page.locator("#controls").is_hidden()
    assert page.locator("#status").text_content() == "queued"

    workers = [worker(url, "--burst", "--name", f"web-gpu{i}") for i, url in enumerate(sims)]
    # A running job with an estimate: the moment the README's screenshot shows.
    wait_js(page, """() => { const e = document.getElementById('eta').dataset.value;
        return document.getElementById('status').textContent === 'running' && e !== '' && Number(e) > 0; }""",
                           timeout=60_000)
    # (8 estimates: the ETA chart shows how it moved, as in the README's screenshot)
    wait_js(page, "charts['chart-eta'].plot.data[1].filter((v) => v !== null).length >= 8", polling=200,
                           timeout=60_000)
    assert page.locator("#bottlenecks tbody tr").count() == 2
    shot = tmp_path / "monitor-web.png"
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("GENQ_WEB_SCREENSHOT"):  # `GENQ_WEB_SCREENSHOT=docs/monitor-web.png pytest tests/test_web.py`
        shutil.copy(shot, os.environ["GENQ_WEB_SCREENSHOT"])

    for w in workers:
        assert w.wait(120) == 0, w.log()
    # Both after the end (the job's dead letters make it 'partial', never 'done'): the page's numbers
    # are `genq monitor --once --json`'s.
    wait_js(page, "document.getElementById('status').textContent === 'partial'", timeout=30_000)
    polls = int(page.evaluate("document.body.dataset.polls"))
    wait_js(page, f"Number(document.body.dataset.polls) >= {polls + 2}")
    once = json.loads(run_genq("monitor", "--once", "--json", "--job", "webjob").stdout)
    shown = page_values(page)
    drawn = page.evaluate(DRAWN)  # every chart has its first series drawn (pixels of its colour)
    assert set(drawn) == {"chart-progress", "chart-eta", "chart-tok", "chart-prompts", "chart-slots", "chart-lengths"}
    for chart, pixels in drawn.items():
        assert pixels > 20, (chart, drawn)
    for field in SAME:
        assert as_number(shown[field]) == once[field], (field, shown[field], once[field])
    assert once["failed"] == n_long == 30 and once["completed"] == 270
    assert page.locator("#dlq-total").get_attribute("data-value") == "30"
    assert page.locator("#dlq-kinds tr[data-kind=bad_request] td").nth(1).text_content() == "30"
    assert page.locator("#dlq-latest tbody tr").count() == 5
    assert page.locator("#manifest").get_attribute("data-value") == str(
        len(list((tmp_path / "out" / "webjob" / "manifest").glob("*.json"))))
    assert problems == [], problems
    assert rconn.exists(keys.job_paused("webjob")) == 0


def test_controls_need_the_flag_and_the_token(tmp_path: Path, redis_url, rconn, procs) -> None:
    from tests.conftest import write_prompts

    write_prompts(tmp_path / "p.jsonl", 10)
    for job in ("ctl", "other"):
        run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", job, "--output", str(tmp_path / "out"))
    proc = run_genq("monitor", "--web", "127.0.0.1:1", "--web-control", check=False)
    assert proc.returncode != 0 and "GENQ_WEB_TOKEN" in proc.stderr
    token = "s3cret-token-of-enough-length"
    port = free_port()
    procs(genq_cmd("monitor", "--web", f"127.0.0.1:{port}", "--web-control", "--json"), name="monitor",
          env={"GENQ_WEB_TOKEN": token})
    base = f"http://127.0.0.1:{port}/"
    wait_http(base)
    assert token not in urllib.request.urlopen(base, timeout=5).read().decode()

    def post(headers: dict) -> int:
        req = urllib.request.Request(base + "api/control", data=json.dumps({"action": "pause", "job": "ctl"}).encode(),
                                     headers={"Content-Type": "application/json", **headers}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert post({}) == 403 and post({"X-Genq-Token": "wrong"}) == 403
    assert not rconn.exists(keys.job_paused("ctl"))
    assert post({"X-Genq-Token": token}) == 200
    assert rconn.exists(keys.job_paused("ctl"))
    def state(job: str) -> dict:
        return json.loads(urllib.request.urlopen(base + f"api/state?job={job}", timeout=5).read())

    # Reports are refreshed every --interval: the pause shows at the next one.
    ctl = wait_until(lambda: (st := state("ctl"))["progress"]["status"] == "paused" and st, 10, "the job paused")
    assert ctl["controls"] is True and ctl["job"] == "ctl"
    # The job picker's list, and the other job on request.
    other = state("other")
    assert other["jobs"] == ["ctl", "other"] and other["job"] == "other" and other["progress"]["status"] == "queued"
    assert post({"X-Genq-Token": token}) == 200  # pausing twice is harmless


def test_only_its_own_host_names_are_answered_and_the_page_runs_under_its_csp(tmp_path: Path, redis_url, procs,
                                                                             browser) -> None:
    from tests.conftest import write_prompts

    write_prompts(tmp_path / "p.jsonl", 10)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "hosts", "--output", str(tmp_path / "out"))
    port = free_port()
    procs(genq_cmd("monitor", "--web", f"127.0.0.1:{port}", "--json", "--interval", "0.5",
                   "--web-allow-host", "genq.example.org"), name="monitor")
    base = f"http://127.0.0.1:{port}/"
    wait_http(base)

    def get(path: str, host: str) -> tuple[int, dict, bytes]:
        req = urllib.request.Request(base + path, headers={"Host": host})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    # A DNS-rebinding page reaches this port under its own name: it reads nothing.
    for host in ("evil.example", f"evil.example:{port}", "localhost.evil.example"):
        for path in ("", "api/state", "static/app.js"):
            status, _, body = get(path, host)
            assert status == 403 and b"hosts" not in body and b"--web-allow-host" in body, (host, path, status, body)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", "genq.example.org",
                 f"GENQ.example.org:{port}", "10.1.2.3:8008"):  # an address is no rebinding: no name to rebind
        status, headers, body = get("api/state", host)
        assert status == 200 and b"hosts" in body, (host, status)
        assert ("default-src 'self'" in headers["Content-Security-Policy"]
                and headers["X-Content-Type-Options"] == "nosniff")

    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto(base)
    wait_js(page, "Number(document.body.dataset.polls || 0) >= 2")
    assert page.locator("#status").text_content() == "queued"
    assert page.evaluate("typeof uPlot") == "function" and page.evaluate("Object.keys(charts).length") > 0
    assert problems == [], problems


def test_a_control_for_a_job_that_is_not_there_changes_nothing(tmp_path: Path, redis_url, rconn, procs) -> None:
    """The page's job can be deleted before its button is pressed: a pause of a job Redis does not know is
    refused (404), not stored to pause the next job of that name; a malformed request is a 400, no traceback."""
    from tests.conftest import write_prompts

    write_prompts(tmp_path / "p.jsonl", 10)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "ctl", "--output", str(tmp_path / "out"))
    token = "s3cret-token-of-enough-length"
    port = free_port()
    monitor = procs(genq_cmd("monitor", "--web", f"127.0.0.1:{port}", "--web-control", "--json"), name="monitor",
                    env={"GENQ_WEB_TOKEN": token})
    base = f"http://127.0.0.1:{port}/"
    wait_http(base)

    def post(body: bytes) -> tuple[int, dict]:
        req = urllib.request.Request(base + "api/control", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "X-Genq-Token": token})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    code, answer = post(json.dumps({"action": "pause", "job": "gone"}).encode())
    assert code == 404 and "gone" in answer["error"], (code, answer)
    assert not rconn.exists(keys.job_paused("gone"))
    for body in (b"not json", b"[1]", json.dumps({"action": "pause", "job": ["ctl"]}).encode(),
                 json.dumps({"action": "pause", "job": "bad/name"}).encode(),
                 json.dumps({"action": "drain", "job": "ctl"}).encode()):  # drains every worker, not a job's
        code, answer = post(body)
        assert code == 400 and answer.get("error"), (body, code, answer)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "gone", "--output", str(tmp_path / "out"))
    assert {j["name"]: j["paused"] for j in json.loads(run_genq("jobs", "--json").stdout)} == {"ctl": False,
                                                                                                "gone": False}
    assert post(json.dumps({"action": "pause", "job": "ctl"}).encode())[0] == 200
    assert rconn.exists(keys.job_paused("ctl")) and not rconn.hlen(keys.job_transport("ctl"))  # its batch parked

    def full(action: str) -> None:  # Redis full: it refuses writes, the answer says so, and nothing changed
        rconn.config_set("maxmemory", "1")
        try:
            code, answer = post(json.dumps({"action": action, "job": "ctl"}).encode())
        finally:
            rconn.config_set("maxmemory", "0")
        assert code == 503 and "Redis is full" in answer.get("error", ""), (code, answer)

    full("resume")
    assert rconn.exists(keys.job_paused("ctl")) and not rconn.hlen(keys.job_transport("ctl"))
    assert post(json.dumps({"action": "resume", "job": "ctl"}).encode())[0] == 200
    assert not rconn.exists(keys.job_paused("ctl")) and rconn.hlen(keys.job_transport("ctl")) == 1
    full("pause")
    assert not rconn.exists(keys.job_paused("ctl"))
    assert "Traceback" not in monitor.log()


def test_a_job_deleted_and_enqueued_again_starts_a_new_history(tmp_path: Path, redis_url, sim, worker,
                                                               procs) -> None:
    """A job deleted and enqueued again under its name is another life (docs/exactly-once.md): the page's
    charts and the monitor's rates start afresh, never with the deleted job's points (150 of 150 done drawn
    before the new job's 2 of 40)."""
    from tests.conftest import write_prompts

    url = sim(step_ms_base=2, step_ms_per_req=0, tokens_per_step=16, mean_output_tokens=32)
    port = free_port()
    procs(genq_cmd("monitor", "--web", f"127.0.0.1:{port}", "--json", "--interval", "0.3"), name="monitor")
    base = f"http://127.0.0.1:{port}/"
    wait_http(base)

    def state() -> dict:
        with urllib.request.urlopen(base + "api/state?job=again", timeout=5) as resp:
            return json.loads(resp.read())

    for n in (12, 3):
        write_prompts(tmp_path / f"p{n}.jsonl", n, start=100 * n)
        run_genq("enqueue", str(tmp_path / f"p{n}.jsonl"), "--job", "again", "--output", str(tmp_path / f"out{n}"))
        assert worker(url, "--burst").wait(90) == 0
        wait_until(lambda n=n: state()["history"]["completed"][-1:] == [n], 20, f"the page's history at {n} done")
        if n == 12:
            run_genq("jobs", "delete", "again", "--yes")
    assert max(state()["history"]["completed"]) == 3
