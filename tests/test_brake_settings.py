"""Settings fixed in place (#25): `genq jobs set` on a running job, and `genq dlq requeue` overrides.

Real processes: a private redis-server, `genq sim --max-context`, `genq enqueue`, `genq worker`,
and the shared exactly-once audit (tests/audit.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from genq.sim.serve import chat_prompt_tokens
from tests.audit import audit
from tests.conftest import run_genq, wait_until, write_prompts


def done_count(redis_url: str, job: str) -> int:
    rows = json.loads(run_genq("jobs", "--json", redis_url=redis_url).stdout)
    return next(r["done"] for r in rows if r["name"] == job)


def test_jobs_set_reaches_a_running_job(redis_url, rconn, sim, worker, tmp_path: Path):
    """Changed mid-run, max_tokens applies to every prompt sent from then on; each record names
    the settings version it was generated with."""
    # ~1.5 s a request, 8 at a time: about 20 s of work, so the change lands early in the run.
    url = sim(max_context=4096, mean_output_tokens=300, output_sigma=0.2, tokens_per_step=8, step_ms_base=40,
              step_ms_per_req=0, max_running_requests=8)
    src = tmp_path / "p.jsonl"
    ids = write_prompts(src, 120)
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "live", "--output", str(out), "--batch-size", "20", "--max-tokens", "1000",
             redis_url=redis_url)
    proc = worker(url, "--burst")
    wait_until(lambda: done_count(redis_url, "live") >= 8, timeout=60, what="some prompts done")
    said = run_genq("jobs", "set", "live", "--max-tokens", "8", redis_url=redis_url).stdout
    assert "settings version 2" in said and "still blocked" not in said, said
    assert proc.wait(timeout=120) == 0, proc.log()
    found = audit(rconn, "live", out, ids)
    by_version: dict[int, list[dict]] = {}
    for record in found.results.values():
        by_version.setdefault(record["settings_version"], []).append(record)
    assert set(by_version) == {1, 2} and len(by_version[1]) >= 8 and len(by_version[2]) >= 40, \
        {v: len(r) for v, r in by_version.items()}
    assert all(r["usage"]["completion_tokens"] <= 8 and r["finish_reason"] == "length" for r in by_version[2])
    assert max(r["usage"]["completion_tokens"] for r in by_version[1]) > 8, "version 1 ran with max_tokens 1000"
    shown = run_genq("jobs", "show", "live", redis_url=redis_url).stdout
    assert "settings version 2: " in shown and "max_tokens 1000 -> 8" in shown, shown


def test_dlq_requeue_overrides_the_settings_for_its_prompts(redis_url, rconn, sim, worker, tmp_path: Path):
    """Four prompts too long for prompt + max_tokens are dead-lettered alone; requeued with
    --max-tokens 50 they fit and finish, the job's own settings unchanged; --extra-body's fields are
    sent as request fields (they were sent inside an 'extra_body' field the server ignores)."""
    url = sim(max_context=1000, mean_output_tokens=30, output_sigma=0.3, tokens_per_step=16, step_ms_base=2)
    src = tmp_path / "p.jsonl"
    ids = write_prompts(src, 20)
    text = "word " * 720
    long_tokens = chat_prompt_tokens([{"role": "user", "content": text}])
    assert 800 < long_tokens < 950, long_tokens  # over 1000 with max_tokens 200, under it with 50
    long_ids = [f"long{i}" for i in range(4)]
    with open(src, "a") as f:
        for pid in long_ids:
            f.write(json.dumps({"id": pid, "messages": [{"role": "user", "content": text}]}) + "\n")
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "ov", "--output", str(out), "--batch-size", "8", "--max-tokens", "200",
             redis_url=redis_url)
    assert worker(url, "--burst").wait(timeout=60) == 0
    letters = json.loads(run_genq("dlq", "list", "--json", "--job", "ov", redis_url=redis_url).stdout)
    assert sorted(e["id"] for e in letters) == long_ids
    assert all(e["message"].startswith("Requested token count exceeds") for e in letters), letters
    said = run_genq("dlq", "requeue", "--all", "--job", "ov", "--max-tokens", "50", "--extra-body",
                    '{"stop_token_ids": [7]}', redis_url=redis_url).stdout
    assert "requeued 4 prompts" in said, said
    assert worker(url, "--burst", name="again").wait(timeout=60) == 0
    found = audit(rconn, "ov", out, ids + long_ids)
    assert not found.letters
    for pid in long_ids:
        record = found.results[pid]
        assert record["usage"]["completion_tokens"] <= 50 and record["settings_version"] == 1, record
        assert "matched_stop" in record, record  # kept only when the request set stop_token_ids
        # Version 1 says max_tokens 200: the record says what overrode it for this prompt.
        assert record["sampling"] == {"max_tokens": 50, "stop_token_ids": [7]}, record
    assert all("sampling" not in r for pid, r in found.results.items() if pid not in long_ids)
    assert run_genq("jobs", "show", "ov", redis_url=redis_url).stdout.count("version 2") == 0


def test_no_brake_lets_a_job_dead_letter_its_prompts(redis_url, rconn, sim, worker, tmp_path: Path):
    """Blocked by the brake, then `genq jobs set --no-brake` + resume: the operator says these prompts
    fail on their own, so each goes to the dead-letter queue and the job ends partial, never blocked."""
    url = sim(max_context=2048, mean_output_tokens=24, step_ms_base=2)
    src = tmp_path / "p.jsonl"
    ids = write_prompts(src, 60)
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "nb", "--output", str(out), "--batch-size", "20", "--max-tokens", "2047",
             redis_url=redis_url)
    assert worker(url, "--burst").wait(timeout=60) == 0
    assert json.loads(run_genq("jobs", "--json", redis_url=redis_url).stdout)[0]["state"] == "blocked"
    run_genq("jobs", "set", "nb", "--no-brake", redis_url=redis_url)
    run_genq("resume", "--job", "nb", redis_url=redis_url)
    assert worker(url, "--burst", name="again").wait(timeout=60) == 0
    found = audit(rconn, "nb", out, ids)  # every prompt a letter: status partial
    assert sorted(found.letters) == ids and not found.results
    assert all(letter.message.startswith("Requested token count exceeds") for letter in found.letters.values())
    row = json.loads(run_genq("jobs", "--json", redis_url=redis_url).stdout)[0]
    assert row["state"] == "partial" and row["blocked"] is None


def test_jobs_set_model_moves_the_job_off_the_servers_of_the_old_model(redis_url, rconn, sim, worker,
                                                                       tmp_path: Path):
    """`genq jobs set J --model big` on a fleet serving two models: no prompt is sent at the new settings
    to a server of the old model (its worker hands the batches it holds back); each record is from a
    server of the model its settings version names."""
    slow = dict(mean_output_tokens=200, output_sigma=0.2, tokens_per_step=8, step_ms_base=40, step_ms_per_req=0,
                max_running_requests=4)
    small = sim(served_model_name="small", **slow)
    big = sim(served_model_name="big", max_running_requests=16, step_ms_base=5, tokens_per_step=32)
    src = tmp_path / "p.jsonl"
    ids = write_prompts(src, 120)
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "moved", "--output", str(out), "--batch-size", "10", "--model", "small",
             redis_url=redis_url)
    on_small = worker(small, "--name", "on-small")
    worker(big, "--name", "on-big")
    wait_until(lambda: done_count(redis_url, "moved") >= 4, timeout=60, what="some prompts done")
    run_genq("jobs", "set", "moved", "--model", "big", redis_url=redis_url)
    wait_until(lambda: any(r["name"] == "moved" and r["state"] == "done"
                           for r in json.loads(run_genq("jobs", "--json", redis_url=redis_url).stdout)),
               timeout=300, what="the job done")
    found = audit(rconn, "moved", out, ids)
    wrong = [(r["id"], r["worker"], r["model"]) for r in found.results.values()
             if (r["settings_version"], r["worker"]) not in ((1, "on-small"), (2, "on-big"))]
    assert not wrong, wrong[:10]
    assert on_small.alive()


@pytest.mark.e2e
def test_jobs_set_says_what_it_changed_and_what_the_job_had_already(redis_url, tmp_path: Path):
    """`genq jobs set` that leaves the job as asked exits 0, whatever part of it was so already: it says which
    settings it changed (a new version holding those alone) and which the job had (no version for them)."""
    src = tmp_path / "p.jsonl"
    write_prompts(src, 5)
    run_genq("enqueue", str(src), "--job", "same", "--output", str(tmp_path / "out"), "--max-tokens", "64",
             redis_url=redis_url)

    def jobs_set(*args: str) -> str:
        done = run_genq("jobs", "set", "same", *args, redis_url=redis_url, check=False)
        assert done.returncode == 0 and not done.stderr, (args, done.returncode, done.stdout, done.stderr)
        return done.stdout

    said = jobs_set("--priority", "3", "--max-tokens", "64")
    assert "priority 3" in said and "max_tokens 64 already" in said and "version 2" not in said, said
    said = jobs_set("--max-tokens", "64")
    assert "max_tokens 64 already" in said and "version 2" not in said, said
    said = jobs_set("--max-tokens", "64", "--temperature", "0.5")
    assert "settings version 2: temperature 0.5" in said and "max_tokens 64 already" in said, said
    shown = json.loads(run_genq("jobs", "show", "same", "--json", redis_url=redis_url).stdout)
    assert shown["row"]["priority"] == 3 and shown["config"]["settings_version"] == 2, shown
    assert [h["changed"] for h in shown["config"]["settings_history"]] == [{"temperature": 0.5}], shown


def test_dlq_requeue_max_tokens_wins_over_the_rows_max_completion_tokens(redis_url, rconn, sim, worker,
                                                                         tmp_path: Path):
    """A row that asked with max_completion_tokens (OpenAI's newer name, which SGLang prefers) and died
    of it: requeued with --max-tokens 50, it is sent with 50 (both were sent; the server kept the row's)."""
    url = sim(max_context=1000, mean_output_tokens=30, output_sigma=0.3, tokens_per_step=16, step_ms_base=2)
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"custom_id": "long", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": "word " * 720}], "max_completion_tokens": 200}}) + "\n")
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "mct", "--output", str(out), "--max-tokens", "200", redis_url=redis_url)
    assert worker(url, "--burst").wait(timeout=60) == 0
    assert [e["id"] for e in json.loads(run_genq("dlq", "list", "--json", redis_url=redis_url).stdout)] == ["long"]
    run_genq("dlq", "requeue", "--all", "--max-tokens", "50", redis_url=redis_url)
    assert worker(url, "--burst", name="again").wait(timeout=60) == 0
    found = audit(rconn, "mct", out, ["long"])
    assert not found.letters and found.results["long"]["sampling"] == {"max_tokens": 50}
