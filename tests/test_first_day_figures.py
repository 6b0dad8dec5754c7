"""The first day on a real fleet (#28): figures true in every state, and values that mean nothing refused.

Each was seen false by a user: a paused worker at 1,707 tok/s and the monitor at 33.83
prompts/s 20 s into a pause, "2,000 (100%)" done beside 5 failed, "elapsed 33s" for a job no
worker had touched, `genq concurrency W 0` taken as "auto".
"""

from __future__ import annotations

import json
import time

from tests.conftest import read_results, run_genq, sim_stats, wait_until, write_prompts
from tests.test_control import SLOW_SIM, enqueue, workers_json
from tests.test_dlq import SMALL_CONTEXT, write_mixed

FAST_SIM = dict(step_ms_base=2, step_ms_per_req=0, tokens_per_step=16, mean_output_tokens=64, output_sigma=1.0)


def monitor_json(job: str) -> dict:
    return json.loads(run_genq("monitor", "--once", "--json", "--job", job).stdout)


def test_a_paused_worker_and_job_show_no_stale_rates(tmp_path, redis_url, sim, worker):
    url = sim(**SLOW_SIM)
    enqueue(tmp_path, "pz", 400)
    worker(url, "--name", "pz-w")
    wait_until(lambda: workers_json().get("pz-w", {}).get("tok_per_s", 0) > 0, 60, "the worker generating")
    wait_until(lambda: monitor_json("pz")["rate_per_sec"], 60, "a job rate")
    run_genq("pause")
    wait_until(lambda: (s := sim_stats(url))["num_running"] == 0 and s["num_waiting"] == 0, 60,
               "in-flight requests done")
    paused_at = time.monotonic()
    row = wait_until(lambda: (w := workers_json()["pz-w"])["state"] == "paused" and w["in_flight"] == 0 and w, 30,
                     "the worker paused with nothing in flight")
    # Within the rates' 30 s window: the old figures were still the last generating ones here.
    doc = monitor_json("pz")
    assert time.monotonic() - paused_at < 20
    assert row["tok_per_s"] == 0 and row["req_per_s"] == 0, row
    assert doc["rate_per_sec"] == 0 and doc["output_tokens_per_sec"] == 0, doc
    text = run_genq("workers").stdout
    assert "0 tok/s in all" in text, text
    run_genq("resume")


def test_jobs_never_shows_100_percent_beside_failed_prompts(tmp_path, redis_url, sim, worker):
    url = sim(context_length=SMALL_CONTEXT, **FAST_SIM)
    write_mixed(tmp_path / "p.jsonl", 1000, long_every=1000)  # one prompt of 1,000 too long: 99.9% done
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "nearly", "--output", str(tmp_path / "out"),
             "--max-tokens", "8", "--batch-size", "250")
    assert worker(url, "--burst").wait(180) == 0
    row = {j["name"]: j for j in json.loads(run_genq("jobs", "--json").stdout)}["nearly"]
    assert row["done"] == 999 and row["failed"] == 1, row
    text = run_genq("jobs").stdout
    assert "999 (99.9%)" in text and "100%" not in text, text


def test_a_job_no_worker_has_touched_shows_no_elapsed_time(tmp_path, redis_url):
    write_prompts(tmp_path / "p.jsonl", 5)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "idle", "--output", str(tmp_path / "out"))
    time.sleep(2.2)
    doc = monitor_json("idle")
    assert doc["elapsed_s"] == 0 and doc["elapsed_hours"] == 0, doc
    text = run_genq("monitor", "--once", "--job", "idle").stdout
    assert "elapsed" not in text and "not started" in text, text


def test_a_finished_job_without_times_is_not_said_not_started(tmp_path, redis_url, rconn):
    """`genq recover` rebuilds the workers' counts from the written output but not when they sent: a job
    whose every prompt is finished has no elapsed time then, and is not "not started" (it was said beside
    "finished")."""
    from genq.core import keys

    write_prompts(tmp_path / "p.jsonl", 5)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "rebuilt", "--output", str(tmp_path / "out"))
    rconn.sadd(keys.job_workers("rebuilt"), "w")
    rconn.hset(keys.worker_stats("rebuilt", "w"), mapping={"done": 5, "failed": 0, "in_tok": 5, "out_tok": 50})
    assert monitor_json("rebuilt")["elapsed_s"] == 0
    text = run_genq("monitor", "--once", "--job", "rebuilt").stdout
    assert "finished" in text and "· not started" not in text, text


def test_values_of_zero_that_mean_nothing_are_refused(redis_url, rconn):
    proc = run_genq("concurrency", "--all", "0", check=False)
    assert proc.returncode == 2 and "at least 1" in proc.stderr and "auto" in proc.stderr, proc.stderr
    proc = run_genq("drain", "--all", "--wait", "--timeout", "0", check=False)
    assert proc.returncode == 2 and "--timeout" in proc.stderr, proc.stderr


def test_the_errors_column_is_per_job(tmp_path, redis_url, sim, worker):
    url = sim(context_length=SMALL_CONTEXT, **FAST_SIM)
    write_mixed(tmp_path / "a.jsonl", 12, long_every=3)  # 4 prompts too long: 4 failed attempts
    run_genq("enqueue", str(tmp_path / "a.jsonl"), "--job", "first", "--max-tokens", "8",
             "--output", str(tmp_path / "out"))
    worker(url, "--name", "one")
    wait_until(lambda: monitor_json("first")["status"] in ("done", "partial"), 60, "the first job finished")
    write_prompts(tmp_path / "b.jsonl", 10)
    run_genq("enqueue", str(tmp_path / "b.jsonl"), "--job", "second", "--max-tokens", "8",
             "--output", str(tmp_path / "out"))
    wait_until(lambda: monitor_json("second")["status"] == "done", 60, "the second job finished")
    time.sleep(2.5)  # a heartbeat after the last outcome

    def errors(job: str) -> int:
        return {w["name"]: w for w in monitor_json(job)["worker_details"]}["one"]["errors"]

    assert errors("first") == 4 and errors("second") == 0, (errors("first"), errors("second"))
    assert workers_json()["one"]["errors"] == 4  # the worker's own total stays in `genq workers`


def test_a_finished_jobs_elapsed_time_and_rate_run_from_its_first_request(redis_url, tmp_path, sim, worker):
    """20 prompts sent together that all take ~1.5 s: elapsed ~1.5 s and ~13 prompts/s, not the
    0.1 s between the first and the last answer (it showed "elapsed 0s" and 61 prompts/s)."""
    write_prompts(tmp_path / "p.jsonl", 20)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "together", "--output", str(tmp_path / "out"))
    url = sim(max_running_requests=32, step_ms_base=50, step_ms_per_req=0, tokens_per_step=1, mean_output_tokens=30,
              output_sigma=0.01)
    assert worker(url, "--burst").wait(timeout=120) == 0
    records = read_results(tmp_path / "out", "together")
    slowest = max(r["latency_s"] for r in records)
    assert slowest >= 1.0, slowest
    doc = json.loads(run_genq("monitor", "--job", "together", "--once", "--json").stdout)
    assert doc["status"] == "done" and doc["elapsed_s"] >= 0.9 * slowest, (doc["elapsed_s"], slowest)
    assert doc["rate_per_sec"] <= 20 / (0.9 * slowest), doc["rate_per_sec"]
    text = run_genq("monitor", "--job", "together", "--once").stdout
    assert f"elapsed {doc['elapsed_s']:.1f}s" in text, text  # a short run in tenths, not "elapsed 2s" or "0s"
