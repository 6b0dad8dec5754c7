"""`genq monitor` against real runs: real Redis, a real `genq sim`, real `genq worker` processes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from genq.core import keys  # noqa: E402
from genq.core.records import BatchRef, InFlight, WorkerStatus, pack, unpack  # noqa: E402
from tests.conftest import genq_cmd, nvml_count, nvml_gpu, read_results, run_genq, wait_until, write_prompts

FAST_SIM = dict(step_ms_base=2, step_ms_per_req=0, tokens_per_step=16, mean_output_tokens=64, output_sigma=1.0)
# Fields the original progress.json carried, plus the range and state.
PROGRESS_FIELDS = {"total", "completed", "failed", "rate_per_sec", "eta_hours", "total_input_tokens",
                   "total_output_tokens", "avg_output_tokens", "elapsed_hours", "status", "eta_low_hours",
                   "eta_high_hours", "eta_state", "in_flight", "queued", "queued_batches", "workers",
                   "s3_uploaded", "s3_bytes", "shards"}
JSON_ONLY = {"eta_s", "eta_low_s", "eta_high_s"}


def small_run(tmp_path: Path, sim, worker, job: str = "mon", n: int = 60, *extra: str) -> Path:
    """Enqueue n prompts and run one burst worker (GPU 0 asked for: there is none here) to the end."""
    url = sim(**FAST_SIM)
    prompts = tmp_path / f"{job}.jsonl"
    write_prompts(prompts, n)
    out = tmp_path / "out"
    run_genq("enqueue", str(prompts), "--job", job, "--output", str(out), "--batch-size", "16")
    proc = worker(url, "--burst", "--gpu", "0", "--name", f"{job}-w", *extra)
    assert proc.wait(90) == 0, proc.log()
    return out


def monitor_json(*args: str) -> dict:
    proc = run_genq("monitor", "--once", "--json", *args)
    return json.loads(proc.stdout)


def gpu_figures_or_note(rconn, worker: str) -> str | None:
    """Where NVML sees GPU 0, check that the worker reported NVML's own figures for it and
    return None; elsewhere return the note the worker gave instead (no driver, no GPU 0)."""
    status = unpack(rconn.get(keys.worker_status(worker)), WorkerStatus)
    if not nvml_count():
        assert status.gpu_sample is None and status.gpu_note, status
        assert status.gpu_note.startswith("no GPU"), status.gpu_note
        return status.gpu_note
    gpu = nvml_gpu(0)
    sample = status.gpu_sample
    assert sample is not None and status.gpu_note is None, status.gpu_note
    assert (sample.index, sample.name, sample.memory_total_mib) == (0, gpu.name, gpu.memory_total_mib)
    assert 0 < sample.memory_used_mib <= gpu.memory_total_mib and 0 <= sample.utilization_pct <= 100
    return None


def test_once_json_and_progress_file_match_the_shards(tmp_path: Path, redis_url, rconn, sim, worker) -> None:
    out = small_run(tmp_path, sim, worker)
    progress_file = tmp_path / "progress" / "progress.json"
    doc = monitor_json("--job", "mon", "--progress-file", str(progress_file))

    rows = read_results(out, "mon")
    assert len(rows) == 60
    assert doc["job"] == "mon" and doc["status"] == "done"
    assert doc["total"] == 60 and doc["completed"] == 60 and doc["failed"] == 0
    assert doc["in_flight"] == 0 and doc["queued"] == 0 and doc["percent"] == 100.0
    out_tokens = sum(r["usage"]["completion_tokens"] for r in rows)
    in_tokens = sum(r["usage"]["prompt_tokens"] for r in rows)
    assert doc["total_output_tokens"] == out_tokens and doc["total_input_tokens"] == in_tokens
    assert doc["avg_output_tokens"] == round(out_tokens / 60, 1)
    shards = sorted((out / "mon" / "shards").glob("*.jsonl"))
    assert (doc["shards"] == doc["s3_uploaded"] == len(shards)
            == len(list((out / "mon" / "manifest").glob("*.json"))) == 4)
    assert doc["s3_bytes"] == sum(p.stat().st_size for p in shards)
    assert doc["shard_records"] == 60
    assert doc["batches_total"] == doc["batches_done"] == 4 and doc["queued_batches"] == 0
    assert doc["eta_state"] == "done" and doc["eta_s"] == doc["eta_low_s"] == doc["eta_high_s"] == 0.0
    assert doc["eta_hours"] == 0.0 and doc["elapsed_s"] > 0
    assert doc["elapsed_hours"] == round(doc["elapsed_s"] / 3600, 4)
    assert PROGRESS_FIELDS | JSON_ONLY <= set(doc)
    # The fitted mean length is near what the shards hold (60 lognormal draws: loose).
    assert doc["expected_output_tokens"] == pytest.approx(out_tokens / 60, rel=0.35)

    (w,) = doc["worker_details"]
    assert w["name"] == "mon-w" and w["job_completed"] == 60 and w["job_output_tokens"] == out_tokens
    # A stopped worker's GPU figures are not figures of now: never shown. Without a GPU 0 the
    # worker says why and the monitor passes it on; with one, there is nothing to excuse.
    note = gpu_figures_or_note(rconn, "mon-w")
    assert w["gpu"] is None and w["gpu_note"] == note
    assert doc["gpu_note"] == (None if note is None else f"no GPU figures from any worker: {note}")

    saved = json.loads(progress_file.read_text())
    assert PROGRESS_FIELDS <= set(saved) and not JSON_ONLY & set(saved)
    for field in ("total", "completed", "failed", "total_output_tokens", "total_input_tokens", "status",
                  "s3_uploaded", "s3_bytes", "eta_state"):
        assert saved[field] == doc[field], field
    assert not list(progress_file.parent.glob(".*.tmp"))  # written beside, then renamed


def test_live_json_lines_and_progress_file_follow_a_run(tmp_path: Path, redis_url, sim, worker, procs) -> None:
    # About 3 s of work (60 x ~160 tokens, 4 slots at 800 tok/s): several refreshes see it running.
    url = sim(step_ms_base=10, step_ms_per_req=0, tokens_per_step=8, mean_output_tokens=160, output_sigma=1.0,
              max_running_requests=4)
    prompts = tmp_path / "live.jsonl"
    write_prompts(prompts, 60)
    run_genq("enqueue", str(prompts), "--job", "live", "--output", str(tmp_path / "out"), "--batch-size", "16")
    progress_file = tmp_path / "progress.json"
    mon = procs(genq_cmd("monitor", "--job", "live", "--json", "--interval", "0.3", "--until-done",
                         "--progress-file", str(progress_file)), name="monitor")
    wait_until(progress_file.exists, 20, "the first progress file")
    first = json.loads(progress_file.read_text())
    assert first["status"] == "queued" and first["completed"] == 0 and first["eta_hours"] is None
    assert not JSON_ONLY & set(first)
    w = worker(url, "--burst", "--name", "live-w")
    assert mon.wait(120) == 0, mon.log()
    assert w.wait(60) == 0

    docs = [json.loads(line) for line in mon.log().splitlines() if line.startswith("{")]
    assert len(docs) >= 3
    assert docs[0]["status"] == "queued" and docs[-1]["status"] == "done"
    completed = [d["completed"] for d in docs]
    assert completed == sorted(completed) and completed[-1] == 60
    running = [d for d in docs if d["status"] == "running"]
    assert running, "no refresh saw the job running"
    assert any(d["in_flight"] > 0 and d["worker_details"] and d["worker_details"][0]["state"] == "busy"
               for d in running)
    assert all(d["eta_state"] in ("warming up", "estimating", "steady") for d in running)
    for d in running:  # a number only with its range, and the range around it
        if d["eta_s"] is not None:
            assert d["eta_low_s"] <= d["eta_s"] <= d["eta_high_s"]
            assert d["eta_hours"] == round(d["eta_s"] / 3600, 4)
    final = json.loads(progress_file.read_text())
    assert final["status"] == "done" and final["completed"] == 60 and final["eta_state"] == "done"


def test_view_without_gpu_says_so_once(tmp_path: Path, redis_url, rconn, sim, worker) -> None:
    small_run(tmp_path, sim, worker, "view")
    proc = run_genq("monitor", "--once")
    text = proc.stdout
    assert "view" in text and "60 / 60" in text and "finished" in text
    assert "view-w" in text
    note = gpu_figures_or_note(rconn, "view-w")
    if note is None:  # a GPU host: GPU 0 was sampled, so nothing to excuse
        assert "no GPU" not in text, text
    else:
        # One line under the table, the worker's own reason in it ("no GPU telemetry", "no GPU 0").
        assert text.count("GPU: no GPU figures from any worker") == 1, text
        assert text.count(note.split(":")[0]) == 1, text


def test_several_jobs_are_keyed_by_name_and_a_missing_one_is_an_error(tmp_path: Path, redis_url) -> None:
    for job, n in (("alpha", 30), ("beta", 20)):
        write_prompts(tmp_path / f"{job}.jsonl", n)
        run_genq("enqueue", str(tmp_path / f"{job}.jsonl"), "--job", job, "--output", str(tmp_path / "out"))
    doc = monitor_json()
    assert set(doc) == {"alpha", "beta"}
    assert doc["alpha"]["total"] == 30 and doc["beta"]["total"] == 20
    for d in doc.values():
        assert d["status"] == "queued" and d["eta_state"] == "warming up" and d["eta_s"] is None
        assert d["queued"] == d["total"] and d["completed"] == 0
    assert monitor_json("--job", "beta")["job"] == "beta"

    proc = run_genq("monitor", "--once", "--json", "--job", "nosuch", check=False)
    assert proc.returncode == 1 and "no job named 'nosuch'" in proc.stderr


def test_no_jobs_gives_an_empty_object(redis_url) -> None:
    assert monitor_json() == {}
    assert "no jobs" in run_genq("monitor", "--once").stdout


def test_paused_job_and_lost_worker(tmp_path: Path, redis_url, rconn) -> None:
    write_prompts(tmp_path / "p.jsonl", 40)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "held", "--output", str(tmp_path / "out"))
    # A worker that worked on the job and whose heartbeat expired: in WORKERS, no status key.
    rconn.sadd(keys.WORKERS, "ghost")
    rconn.sadd(keys.job_workers("held"), "ghost")
    rconn.hset(keys.worker_stats("held", "ghost"), mapping={"done": 5, "failed": 0, "in_tok": 50, "out_tok": 640,
                                                             "first_at": time.time() - 60, "last_at": time.time() - 30})
    rconn.hset(keys.job_hist("held"), mapping={"28": 5})
    doc = monitor_json("--job", "held")
    assert doc["status"] == "running" and doc["completed"] == 5 and doc["total_output_tokens"] == 640
    (ghost,) = doc["worker_details"]
    assert ghost["state"] == "lost" and doc["workers_lost"] == 1 and ghost["job_completed"] == 5
    text = run_genq("monitor", "--once", "--job", "held").stdout
    assert "lost" in text and "ghost" in text

    rconn.set(keys.job_paused("held"), 1)
    doc = monitor_json("--job", "held")
    assert doc["status"] == "paused" and doc["eta_state"] == "paused" and doc["eta_s"] is None


def test_an_idle_worker_of_another_model_is_no_help_to_a_job(tmp_path: Path, redis_url, rconn) -> None:
    """Workers route by model: job A's ETA counts the idle workers that may take its batches (its model's,
    or any while it is `--model auto`), never another model's. Statuses written as a worker writes them."""
    for job, model in (("for-a", "model-A"), ("for-any", "auto")):
        write_prompts(tmp_path / f"{job}.jsonl", 100)
        run_genq("enqueue", str(tmp_path / f"{job}.jsonl"), "--job", job, "--output", str(tmp_path / "out"),
                 "--model", model)
        rconn.hset(keys.job_hist(job), mapping={"28": 25})  # enough finished to fit the lengths
    now = time.time()

    def idle(name: str, model: str) -> None:
        status = WorkerStatus(name=name, host="h", pid=1, server=f"http://{name}", state="idle",
                              started_at=now - 100, heartbeat_at=now, concurrency_target=8, model=model)
        rconn.set(keys.worker_status(name), pack(status), ex=60)
        rconn.sadd(keys.WORKERS, name)

    idle("b-idle", "model-B")
    a, any_ = monitor_json("--job", "for-a"), monitor_json("--job", "for-any")
    assert (a["eta_state"], a["eta_note"]) == ("stalled", "no live worker has slots for this job"), a
    assert any_["eta_state"] == "warming up", any_  # model-B's worker takes an auto job
    idle("a-idle", "model-A")
    assert monitor_json("--job", "for-a")["eta_state"] == "warming up"


def test_worker_rows_show_slots_and_bottlenecks(tmp_path: Path, redis_url, rconn) -> None:
    """Efficiency columns and bottleneck lines come from WorkerStatus; written here as a worker would."""
    write_prompts(tmp_path / "p.jsonl", 100)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "eff", "--output", str(tmp_path / "out"))
    now = time.time()
    capped = WorkerStatus(name="w-capped", host="h1", pid=1, server="http://s1", state="busy", started_at=now - 100,
                          heartbeat_at=now, concurrency_target=8, concurrency_limit=8, server_capacity=32,
                          in_flight=8, queued=20, server_running=8.0, server_waiting=0.0, server_token_usage=0.2,
                          tok_per_s=900.0, gpu_note="no GPU telemetry: NVMLError_LibraryNotFound")
    full = WorkerStatus(name="w-full", host="h2", pid=2, server="http://s2", state="busy", started_at=now - 100,
                        heartbeat_at=now, concurrency_target=40, server_capacity=32, in_flight=40, queued=5,
                        server_running=32.0, server_waiting=8.0, server_token_usage=0.99, tok_per_s=3000.0,
                        gpu_note="no GPU telemetry: NVMLError_LibraryNotFound")
    down = WorkerStatus(name="w-down", host="h3", pid=3, server="http://s3", state="server_down", started_at=now - 100,
                        heartbeat_at=now, note="health check failed")
    for s in (capped, full, down):
        rconn.set(keys.worker_status(s.name), pack(s), ex=60)
        rconn.sadd(keys.WORKERS, s.name)
        rconn.set(keys.job_inflight("eff", s.name),
                  pack(InFlight(worker=s.name, job="eff", at=now, tokens=[5] * s.in_flight, queued=s.queued)), ex=60)
    doc = monitor_json("--job", "eff")
    by_name = {w["name"]: w for w in doc["worker_details"]}
    assert by_name["w-capped"]["slot_utilization"] == 0.25 and by_name["w-full"]["slot_utilization"] == 1.0
    assert any("concurrency cap 8 below server capacity 32" in b for b in by_name["w-capped"]["bottlenecks"])
    assert any("KV cache full" in b for b in by_name["w-full"]["bottlenecks"])
    assert any(b.startswith("server down") for b in by_name["w-down"]["bottlenecks"])
    assert doc["in_flight"] == 48
    text = run_genq("monitor", "--once", "--job", "eff").stdout
    assert "concurrency cap 8 below server capacity 32" in text and "KV cache full" in text
    assert "25%" in text and "100%" in text
    assert text.count("no GPU telemetry") == 1


# ---------------------------------------------------------------- figures that were wrong (issue #16)


def worker_status(rconn, name: str) -> WorkerStatus | None:
    from genq.core.records import unpack

    raw = rconn.get(keys.worker_status(name))
    return unpack(raw, WorkerStatus) if raw else None


def test_a_paused_job_parks_its_batches_and_the_monitor_says_so(tmp_path: Path, redis_url, rconn, sim, worker) -> None:
    """`genq pause --job` parks the job's batches once its requests finish (#26): the worker holds none
    of them and its slots are free; the monitor shows them parked, not lost elsewhere."""
    url = sim(step_ms_base=10, step_ms_per_req=0, tokens_per_step=8, mean_output_tokens=400, output_sigma=0.3,
              max_running_requests=4)
    write_prompts(tmp_path / "p.jsonl", 80)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "pz", "--output", str(tmp_path / "out"),
             "--batch-size", "8")
    w = worker(url, "--prefetch", "4", "--name", "pz-w")
    wait_until(lambda: (s := worker_status(rconn, "pz-w")) and len(s.batches) >= 4, 30, "the worker to hold 4 batches")
    run_genq("pause", "--job", "pz")
    wait_until(lambda: (s := worker_status(rconn, "pz-w")) and not s.batches and s.in_flight == 0, 60,
               "the worker to park the paused job's batches")
    doc = monitor_json("--job", "pz")
    assert doc["status"] == "paused"
    assert doc["held_batches"] == 0 and doc["queued_batches"] == 0 and doc["in_flight"] == 0
    parked = doc["batches_total"] - doc["batches_done"]
    assert parked > 0 and doc["other_batches"] == parked
    assert doc["queued"] == 80 - doc["completed"] - doc["failed"] > 0, "parked prompts are not started"
    text = run_genq("monitor", "--once", "--job", "pz").stdout
    flat = " ".join(text.replace("│", " ").split())  # the panel wraps its lines
    assert f"{parked} parked while the job is paused" in flat and "elsewhere" not in flat, text
    w.kill_tree()


def test_queued_batches_are_what_rq_shows(tmp_path: Path, redis_url, rconn) -> None:
    """Batches not in RQ's queue (here: removed from it, as after a failed or orphaned run) are not 'queued'."""
    from genq.core.queueing import rq_queue

    write_prompts(tmp_path / "p.jsonl", 72)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "rqv", "--output", str(tmp_path / "out"),
             "--batch-size", "8")
    doc = monitor_json("--job", "rqv")
    assert doc["queued_batches"] == doc["rq_queued"] == rq_queue(rconn).count == 9 and doc["other_batches"] == 0
    rq_queue(rconn).empty()
    assert rq_queue(rconn).count == 0
    doc = monitor_json("--job", "rqv")
    assert doc["queued_batches"] == 0 and doc["rq_queued"] == 0
    assert doc["other_batches"] == 9 and doc["queued"] == 72  # the prompts are still not started
    text = run_genq("monitor", "--once", "--job", "rqv").stdout
    assert "9 batches in the queue" not in text
    assert "0 in RQ's queue" in text and "9 elsewhere" in text, text


def test_a_batch_a_live_worker_has_leased_is_held_before_its_next_heartbeat_names_it(tmp_path: Path, redis_url,
                                                                                     rconn) -> None:
    """Between a worker's lease of a batch and its next status record (a second), the batch is held,
    not "elsewhere (retrying, failed in RQ or orphaned)": seen at every batch boundary on the page.
    A lease of an engine that stopped beating stays elsewhere."""
    from genq.core.queueing import rq_queue

    write_prompts(tmp_path / "p.jsonl", 24)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "lz", "--output", str(tmp_path / "out"),
             "--batch-size", "8")
    rq_queue(rconn).empty()  # taken off the queue by the workers (TAKE)
    rconn.hset(keys.job_leases("lz"), mapping={"b0000001": "tok1 eng-live", "b0000002": "tok2 eng-dead"})
    rconn.set(keys.engine_alive("eng-live"), "w", ex=60)  # its worker was idle at its last beat: names no batch
    now = time.time()
    rconn.set(keys.worker_status("w"), pack(WorkerStatus(name="w", host="h", pid=1, server="http://s", state="idle",
                                                         started_at=now - 60, heartbeat_at=now)), ex=60)
    rconn.sadd(keys.WORKERS, "w")
    doc = monitor_json("--job", "lz")
    assert (doc["held_batches"], doc["other_batches"], doc["queued"]) == (1, 2, 24), doc
    text = run_genq("monitor", "--once", "--job", "lz").stdout
    assert "1 held by workers" in text and "2 elsewhere" in text, text


def test_a_finished_job_has_one_rate_live_and_once(tmp_path: Path, redis_url, sim, worker, procs) -> None:
    url = sim(step_ms_base=10, step_ms_per_req=0, tokens_per_step=8, mean_output_tokens=160, output_sigma=1.0,
              max_running_requests=4)
    write_prompts(tmp_path / "p.jsonl", 60)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "rate", "--output", str(tmp_path / "out"),
             "--batch-size", "16")
    mon = procs(genq_cmd("monitor", "--job", "rate", "--json", "--interval", "0.3"), name="monitor")
    w = worker(url, "--burst", "--name", "rate-w")
    assert w.wait(90) == 0, w.log()

    def live_done() -> dict | None:
        docs = [json.loads(line) for line in mon.log().splitlines() if line.startswith("{")]
        done = [d for d in docs if d["status"] == "done"]
        return len(done) >= 3 and done[-1]  # a few refreshes after the end: the idle tail is sampled

    live = wait_until(live_done, 30, "the live monitor to see the job done")
    once = monitor_json("--job", "rate")
    assert once["status"] == "done"
    for field in ("rate_per_sec", "output_tokens_per_sec", "elapsed_s", "completed", "total_output_tokens"):
        assert live[field] == once[field], (field, live[field], once[field])
    assert once["rate_per_sec"] == pytest.approx(60 / once["elapsed_s"], rel=1e-3)  # the whole run


def test_dead_letters_are_not_shown_as_done(tmp_path: Path, redis_url, sim, worker) -> None:
    from tests.test_dlq import SMALL_CONTEXT, write_mixed

    url = sim(context_length=SMALL_CONTEXT, **FAST_SIM)
    _, long_ids = write_mixed(tmp_path / "p.jsonl", 30, long_every=3)  # every third prompt is too long
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "dl", "--output", str(tmp_path / "out"),
             "--max-tokens", "16")
    assert worker(url, "--burst", "--name", "dl-w").wait(60) == 0
    doc = monitor_json("--job", "dl")
    assert (doc["failed"] == len(long_ids) == 10 and doc["completed"] == 20
            and doc["status"] == "partial")  # never "done" with dead letters (#25)
    assert doc["percent_completed"] == 66.67 and doc["percent_failed"] == 33.33
    text = run_genq("monitor", "--once", "--job", "dl").stdout
    assert "30 / 30" not in text and "100.0%" not in text, text
    assert "20 / 30 done (66.7%)" in text and "10 failed (33.3%)" in text, text


def test_once_has_no_refresh_footer(tmp_path: Path, redis_url) -> None:
    write_prompts(tmp_path / "p.jsonl", 10)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "ft", "--output", str(tmp_path / "out"))
    text = run_genq("monitor", "--once").stdout
    assert "Ctrl-C" not in text and "every 2s" not in text, text
    assert "Ctrl-C" not in run_genq("monitor", "--once", "--job", "ft").stdout


def test_until_done_waits_for_every_shard(tmp_path: Path, redis_url, rconn, procs) -> None:
    """Every prompt has a result but the last batch's shard is not written yet: not done."""
    write_prompts(tmp_path / "p.jsonl", 16)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "ud", "--output", str(tmp_path / "out"),
             "--batch-size", "8")
    # As the worker leaves it between the last result and the shard of batch 2: counters full, one batch done.
    rconn.hset(keys.worker_stats("ud", "w"), mapping={"done": 16, "failed": 0, "in_tok": 160, "out_tok": 1600,
                                                       "first_at": time.time() - 10, "last_at": time.time()})
    rconn.sadd(keys.job_workers("ud"), "w")
    rconn.sadd(keys.job_done("ud"), "b0000001")
    mon = procs(genq_cmd("monitor", "--job", "ud", "--json", "--interval", "0.2", "--until-done"), name="monitor")

    def docs() -> list[dict]:
        return [json.loads(line) for line in mon.log().splitlines() if line.startswith("{")]

    wait_until(lambda: len(docs()) >= 3 or not mon.alive(), 30, "three refreshes")
    assert mon.alive(), "--until-done returned before the last shard was written"
    assert docs()[-1]["status"] == "writing" and docs()[-1]["batches_done"] == 1
    rconn.sadd(keys.job_done("ud"), "b0000002")
    assert mon.wait(30) == 0
    assert docs()[-1]["status"] == "done"


def test_a_stopped_worker_shows_no_figures_of_its_last_moments(redis_url, rconn) -> None:
    from tests.test_prometheus import put_job

    put_job(rconn, time.time())  # gpu-e stopped with its last tok/s 999 and 3 requests on its server
    (e,) = [w for w in monitor_json("--job", "exp")["worker_details"] if w["name"] == "gpu-e"]
    assert e["state"] == "stopped" and e["tok_per_s"] == 0 and e["slot_utilization"] is None
    assert e["server_running"] is None and e["in_flight"] == 0
    row = next(line for line in run_genq("monitor", "--once", "--job", "exp").stdout.splitlines() if "gpu-e" in line)
    assert "999" not in row and "%" not in row, row


def test_a_worker_row_of_several_jobs_counts_what_it_did_for_each(tmp_path: Path, redis_url, rconn) -> None:
    """The terminal shows a worker once with several jobs: its done and errors are its sums over them, not
    the first job's (a worker that finished 5 prompts of the second job read "done 0")."""
    for job in ("first", "second"):
        write_prompts(tmp_path / f"{job}.jsonl", 20)
        run_genq("enqueue", str(tmp_path / f"{job}.jsonl"), "--job", job, "--output", str(tmp_path / "out"))
    now = time.time()
    status = WorkerStatus(name="w-both", host="h", pid=1, server="http://s", state="idle", started_at=now - 100,
                          heartbeat_at=now, concurrency_target=8, errors=4, job_errors={"first": 1, "second": 3})
    rconn.set(keys.worker_status("w-both"), pack(status), ex=60)
    rconn.sadd(keys.WORKERS, "w-both")
    for job, done in (("first", 2), ("second", 5)):
        rconn.sadd(keys.job_workers(job), "w-both")
        rconn.hset(keys.worker_stats(job, "w-both"), mapping={"done": done, "failed": 0, "in_tok": 1, "out_tok": 9})
    doc = monitor_json()
    assert [doc[j]["worker_details"][0]["job_completed"] for j in ("first", "second")] == [2, 5]
    row = next(line for line in run_genq("monitor", "--once").stdout.splitlines() if line.startswith("w-both"))
    cells = [c.strip() for c in row.split("│")]
    assert (cells[7], cells[8]) == ("7", "4"), row


def test_a_job_enqueued_again_after_its_delete_has_no_rate_of_the_deleted_one(tmp_path: Path, redis_url,
                                                                               rconn) -> None:
    """The monitor's samples are of one life of a job: a job deleted and enqueued again under its name starts
    without a rate (one sample), never with the deleted job's samples (which read 0.0 prompts/s here)."""
    from genq.monitor.progress import Monitor

    mon = Monitor(rconn, "again", window_s=60)
    for n in (20, 30):
        write_prompts(tmp_path / f"p{n}.jsonl", n, start=100 * n)
        run_genq("enqueue", str(tmp_path / f"p{n}.jsonl"), "--job", "again", "--output", str(tmp_path / "out"))
        rconn.sadd(keys.job_workers("again"), "w")
        rconn.hset(keys.worker_stats("again", "w"), mapping={"done": 5, "failed": 0, "in_tok": 5, "out_tok": 50})
        (first,) = mon.refresh()
        time.sleep(0.05)
        if n == 20:
            (second,) = mon.refresh()
            assert second.progress.rate_per_sec == 0.0 and second.progress.status == "running"
            run_genq("jobs", "delete", "again", "--yes")
    assert first.progress.total == 30 and first.progress.rate_per_sec is None, first.progress


def test_a_worker_lost_while_one_of_its_jobs_runs_is_shown_lost(tmp_path: Path, redis_url, rconn) -> None:
    """A worker whose heartbeat expired is "gone" for a job that is done and "lost" for one still
    running: its one row in the terminal says lost (with the lost line), whichever job is listed first."""
    for job, done in (("a-done", 20), ("b-run", 5)):
        write_prompts(tmp_path / f"{job}.jsonl", 20)
        run_genq("enqueue", str(tmp_path / f"{job}.jsonl"), "--job", job, "--output", str(tmp_path / "out"))
        rconn.sadd(keys.job_workers(job), "ghost")
        rconn.hset(keys.worker_stats(job, "ghost"), mapping={"done": done, "failed": 0, "in_tok": 1, "out_tok": 9})
    rconn.sadd(keys.WORKERS, "ghost")
    doc = monitor_json()
    assert [doc[j]["worker_details"][0]["state"] for j in ("a-done", "b-run")] == ["gone", "lost"]
    text = run_genq("monitor", "--once").stdout
    row = next(line for line in text.splitlines() if line.startswith("ghost"))
    assert "lost" in row and "lost ghost" in text, text


def test_a_job_whose_only_worker_drains_with_prompts_it_does_not_hold_is_stalled(tmp_path: Path, redis_url,
                                                                                 rconn) -> None:
    """A draining worker finishes the batches it holds and exits: it takes none of the job's other
    prompts, so with nobody else to take them the job has no ETA; it is stalled, not warming up."""
    write_prompts(tmp_path / "p.jsonl", 100)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "drn", "--output", str(tmp_path / "out"))
    rconn.hset(keys.job_hist("drn"), mapping={"28": 25})  # enough finished to fit the lengths
    now = time.time()
    status = WorkerStatus(name="w-drain", host="h", pid=1, server="http://s", state="draining", started_at=now - 100,
                          heartbeat_at=now, concurrency_target=8, in_flight=8, tok_per_s=500.0)
    rconn.set(keys.worker_status("w-drain"), pack(status), ex=60)
    rconn.sadd(keys.WORKERS, "w-drain")
    running = InFlight(worker="w-drain", job="drn", at=now, tokens=[5] * 8, queued=0)
    rconn.set(keys.job_inflight("drn", "w-drain"), pack(running), ex=60)
    doc = monitor_json("--job", "drn")
    assert (doc["eta_state"], doc["eta_note"]) == ("stalled", "no live worker has slots for this job"), doc


def test_a_worker_forgotten_by_prune_is_not_shown_lost(tmp_path: Path, redis_url, rconn) -> None:
    """`genq workers --prune` forgets stopped and lost workers: a job one of them worked on keeps its
    counts, but the worker is not lost for it (no workers_lost, no lost line); it is gone."""
    write_prompts(tmp_path / "p.jsonl", 20)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "pr", "--output", str(tmp_path / "out"))
    now = time.time()
    stopped = WorkerStatus(name="w-stop", host="h", pid=1, server="http://s", state="stopped", started_at=now - 100,
                           heartbeat_at=now - 50)
    rconn.set(keys.worker_status("w-stop"), pack(stopped))  # a stopped worker's record is kept, without TTL
    rconn.sadd(keys.WORKERS, "w-stop")
    rconn.sadd(keys.job_workers("pr"), "w-stop")
    rconn.hset(keys.worker_stats("pr", "w-stop"), mapping={"done": 5, "failed": 0, "in_tok": 1, "out_tok": 9})
    assert monitor_json("--job", "pr")["worker_details"][0]["state"] == "stopped"
    assert "forgot 1" in run_genq("workers", "--prune").stdout
    doc = monitor_json("--job", "pr")
    (row,) = doc["worker_details"]
    assert (doc["workers_lost"], row["state"], row["job_completed"], doc["completed"]) == (0, "gone", 5, 5), doc
    assert row["bottlenecks"] == [] and row["bottleneck_codes"] == []
    assert "lost" not in run_genq("monitor", "--once", "--job", "pr").stdout


def test_a_deleted_job_leaves_no_samples_or_history_behind(redis_url, rconn) -> None:
    """A days-long monitor over many jobs keeps samples and history only of the jobs still there: a deleted
    job's are dropped at the next refresh (they grew without end)."""
    from genq.monitor.progress import Monitor
    from genq.monitor.webapp import History
    from genq.ops.control import delete_job, find_job
    from tests.test_prometheus import put_job

    history = History()
    mon = Monitor(rconn, on_refresh=history.record)
    put_job(rconn, time.time())
    mon.refresh()
    assert list(mon.trackers) == [("exp", mon.last[0].snapshot.config.incarnation)] and list(history.points) == ["exp"]
    delete_job(rconn, find_job(rconn, "exp"))
    assert mon.refresh() == []
    assert mon.trackers == {} and history.points == {}


def test_a_silent_worker_is_no_help_to_the_eta(redis_url, rconn) -> None:
    """A killed worker's record says "busy" until it expires; once its beats are late the views show it silent
    and count no live worker on the job (`workers` 0, genq_worker_up 0): the ETA counts none either, so it
    says stalled, not "warming up" on a worker that is gone."""
    from genq.core.queueing import save_config
    from genq.core.records import JobConfig
    from genq.monitor.progress import Monitor

    save_config(rconn, JobConfig(name="s", output="/tmp/unused", max_tokens=2048, batch_size=50))
    rconn.hset(keys.job_stats("s"), mapping={"total": 1000, "batches": 20})
    now = time.time()
    status = WorkerStatus(name="w", host="h", pid=1, server="http://s", state="busy", started_at=now - 60,
                          heartbeat_at=now - 8, concurrency_target=10, in_flight=10)
    rconn.set(keys.worker_status("w"), pack(status), ex=60)
    rconn.sadd(keys.WORKERS, "w")
    rconn.sadd(keys.job_workers("s"), "w")
    rconn.hset(keys.worker_stats("s", "w"), mapping={"done": 100, "out_tok": 9000})
    rconn.hset(keys.job_hist("s"), mapping={"24": 30, "26": 40, "28": 30})
    (r,) = Monitor(rconn, "s").refresh()
    p = r.progress
    assert [w.state for w in p.worker_details] == ["silent"] and p.workers == 0
    assert p.eta_state == "stalled", (p.eta_state, p.eta_note)


@pytest.mark.parametrize("age, state, held", [(0.5, "busy", 4), (8.0, "silent", 0)])
def test_a_silent_workers_batches_are_held_by_no_one_in_any_view(redis_url, rconn, age, state, held) -> None:
    """One rule (figures.beating): a worker's batches are held, its requests running, and it a worker on the job
    only while its beats are on time. A silent one's 4 batches (2 named in its record, 2 leased by its engine whose
    alive key lives on) are elsewhere in the monitor, the page's record, Prometheus and `genq jobs` alike."""
    from prometheus_client import generate_latest

    from genq.core.queueing import save_config
    from genq.core.records import JobConfig
    from genq.monitor.exporter import make_registry
    from genq.monitor.progress import Monitor
    from genq.ops.control import job_rows
    from tests.test_prometheus import samples

    save_config(rconn, JobConfig(name="s", output="/tmp/unused", max_tokens=2048, batch_size=50))
    rconn.hset(keys.job_stats("s"), mapping={"total": 200, "batches": 4})
    rconn.zadd(keys.job_batches("s"), {f"b{i}": i for i in range(4)})
    for i in range(4):
        rconn.set(keys.batch("s", f"b{i}"), b"x")
    rconn.hset(keys.job_leases("s"), mapping={"b2": "t2 w-i1", "b3": "t3 w-i1"})
    rconn.set(keys.engine_alive("w-i1"), "w", ex=60)
    now = time.time()
    status = WorkerStatus(name="w", host="h", pid=1, server="http://s", state="busy", started_at=now - 60,
                          heartbeat_at=now - age, concurrency_target=10, in_flight=10,
                          batches=[BatchRef("s", "b0"), BatchRef("s", "b1")])
    rconn.set(keys.worker_status("w"), pack(status), ex=60)
    rconn.sadd(keys.WORKERS, "w")
    rconn.sadd(keys.job_workers("s"), "w")
    rconn.set(keys.job_inflight("s", "w"), pack(InFlight(worker="w", job="s", at=now - age, tokens=[5] * 10,
                                                          queued=40)), ex=60)
    monitor = Monitor(rconn, "s")
    m = samples(generate_latest(make_registry(monitor)).decode())
    p = monitor.last[0].progress
    assert [w.state for w in p.worker_details] == [state]
    assert (p.held_batches, p.other_batches, p.workers) == (held, 4 - held, held // 4), p
    assert (p.held, p.in_flight) == ((2 * 50 - 10, 10) if held else (0, 0)), p
    assert m[("genq_job_batches_held", (("job", "s"),))] == held
    assert m[("genq_job_workers", (("job", "s"),))] == held // 4
    (row,) = job_rows(rconn, ["s"])
    assert (row.workers, row.running) == ((["w"], 10) if held else ([], 0)), row
