"""Issue #12 "The first hour" and #10: what a new user hits in their first enqueues.

Rows fitted to the job's endpoint, settings checked at enqueue, failed enqueues
that leave nothing behind, rejects under the job's output, `genq jobs delete`,
concurrent enqueues of one input, passwords masked in every URL form.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from genq.core import keys
from genq.core.queueing import fetch_rq_jobs, rq_queue
from genq.core.records import BatchRef, Rejected, WorkerStatus, pack
from genq.core.redisconn import mask_url
from tests.conftest import ROOT, batch_prompts, descendants, free_port, genq_cmd, run_genq, write_prompts

CHAT = [{"role": "user", "content": "hello"}]


def _lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _stored_prompts(rconn, job: str) -> list:
    ids = [b.decode() for b in rconn.zrange(keys.job_batches(job), 0, -1)]
    return [p for bid in ids for p in batch_prompts(rconn, job, bid)]


def _rejects(path: Path) -> list[Rejected]:
    return [msgspec.json.decode(line, type=Rejected) for line in path.read_bytes().splitlines()]


# ---------------------------------------------------------------- item 1: rows fitted to the endpoint


def test_prompt_rows_are_queued_as_one_user_message_for_the_chat_endpoint(redis_url, rconn, tmp_path):
    src = _lines(tmp_path / "mixed.jsonl", [
        {"id": "a1", "messages": CHAT},
        {"id": "a2", "prompt": "Write a haiku."},
        {"custom_id": "r1", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once upon", "max_tokens": 9}},
    ])
    proc = run_genq("enqueue", str(src), "--job", "fit", "--output", str(tmp_path / "out"), redis_url=redis_url)
    assert "queued 3 prompts" in proc.stdout
    assert "2 'prompt' rows sent as one user message each" in proc.stdout
    prompts = {p.id: p for p in _stored_prompts(rconn, "fit")}
    assert prompts["a2"].messages == [{"role": "user", "content": "Write a haiku."}] and prompts["a2"].prompt is None
    assert (prompts["r1"].messages == [{"role": "user", "content": "Once upon"}]
            and prompts["r1"].sampling == {"max_tokens": 9})
    assert prompts["a1"].messages == CHAT


def test_chat_rows_are_refused_for_the_completions_endpoint_naming_the_chat_endpoint(redis_url, rconn, tmp_path):
    src = _lines(tmp_path / "mixed.jsonl", [
        {"id": "a1", "messages": CHAT},
        {"id": "a2", "prompt": "Once upon a time"},
        {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": CHAT}},
    ])
    out = tmp_path / "out"
    proc = run_genq("enqueue", str(src), "--job", "comp", "--endpoint", "completions", "--output", str(out),
                    redis_url=redis_url, check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "queued 1 prompt in" in proc.stdout
    by_line = {r.line: r.reason for r in _rejects(out / "comp" / "rejects" / "mixed.rejects.jsonl")}
    assert sorted(by_line) == [1, 3]
    assert all("--endpoint chat" in reason for reason in by_line.values())
    assert "/v1/chat/completions" in by_line[3]
    assert [p.prompt for p in _stored_prompts(rconn, "comp")] == ["Once upon a time"]


# ---------------------------------------------------------------- item 2: settings checked at enqueue


@pytest.mark.parametrize("option, value, expect", [
    ("--temperature", "-1", "--temperature"),
    ("--top-p", "1.5", "--top-p"),
    ("--top-p", "0", "--top-p"),
])
def test_out_of_range_options_are_refused_before_anything_is_created(redis_url, rconn, tmp_path, option, value, expect):
    src = tmp_path / "p.jsonl"
    write_prompts(src, 3)
    proc = run_genq("enqueue", str(src), "--job", "bad", option, value, redis_url=redis_url, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expect in proc.stderr
    assert rconn.keys("*") == []


@pytest.mark.parametrize("extra, expect", [
    ('{"temprature": 0.5}', "unknown request field 'temprature' (did you mean 'temperature'?); known fields: "),
    ('{"temperature": "hot"}', "temperature must be a number"),
    ('{"top_k": 2.5}', "top_k must be an integer"),
    ('{"stream": false}', "'stream' cannot be set here"),
    ('[1]', "must be a JSON object"),
    ('{bad', "is not valid JSON"),
    ('{"echo": true}', "'echo' is a /v1/completions field"),  # the default endpoint is chat's
    ('{"temperature": NaN}', "--extra-body has NaN, which JSON cannot send"),  # it would go out as null
    ('{"length_penalty": Infinity}', "--extra-body has Infinity, which JSON cannot send"),
    ('{"chat_template_kwargs": {"x": 1e999}}', "--extra-body has 1e999, which JSON cannot send"),  # inf
    # The job's own options: one here was sent over them, and `genq jobs set --temperature` then changed nothing.
    ('{"temperature": 0.9}', "'temperature' cannot be set here; the job's temperature is --temperature"),
    ('{"top_p": 0.5}', "'top_p' cannot be set here; the job's top_p is --top-p"),
])
def test_bad_extra_body_is_refused_naming_the_option_and_field(redis_url, rconn, tmp_path, extra, expect):
    """A bad value is bad usage, exit 2, as `genq jobs set` and `genq dlq requeue` say it (enqueue said 1)."""
    src = tmp_path / "p.jsonl"
    write_prompts(src, 3)
    proc = run_genq("enqueue", str(src), "--job", "bad", "--extra-body", extra, redis_url=redis_url, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "--extra-body" in proc.stderr and expect in proc.stderr
    if "known fields" in expect:
        assert "chat_template_kwargs" in proc.stderr and "max_completion_tokens" in proc.stderr
    assert rconn.keys("*") == []


def test_bad_extra_body_exits_2_on_every_command(redis_url, rconn, tmp_path):
    src = tmp_path / "p.jsonl"
    write_prompts(src, 1)
    run_genq("enqueue", str(src), "--job", "ok", "--output", str(tmp_path / "out"), redis_url=redis_url)
    for extra in ('{bad', '{"temprature": 1}', '{"max_tokens": 9}'):  # for the job's endpoint: test_dlq, test_fidelity
        for args in (("jobs", "set", "ok"), ("dlq", "requeue", "--all", "--job", "ok")):
            proc = run_genq(*args, "--extra-body", extra, redis_url=redis_url, check=False)
            assert proc.returncode == 2 and "--extra-body" in proc.stderr, (args, extra, proc.stdout + proc.stderr)
            assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("model", ["", "  "])
def test_an_empty_model_is_refused_on_every_command(redis_url, rconn, tmp_path, model):
    src = tmp_path / "p.jsonl"
    write_prompts(src, 1)
    proc = run_genq("enqueue", str(src), "--job", "em", "--model", model, redis_url=redis_url, check=False)
    assert proc.returncode == 2 and "--model" in proc.stderr, proc.stdout + proc.stderr
    assert rconn.keys("*") == []
    run_genq("enqueue", str(src), "--job", "em", "--output", str(tmp_path / "out"), redis_url=redis_url)
    proc = run_genq("jobs", "set", "em", "--model", model, redis_url=redis_url, check=False)
    assert proc.returncode == 2 and "--model" in proc.stderr, proc.stdout + proc.stderr
    assert "model" not in run_genq("jobs", "show", "em", redis_url=redis_url).stdout.split("version 1")[-1]


def test_bad_row_sampling_is_rejected_with_its_line(redis_url, rconn, tmp_path):
    src = _lines(tmp_path / "s.jsonl", [
        {"id": "ok", "messages": CHAT,
         "sampling": {"temperature": 0.2, "chat_template_kwargs": {"enable_thinking": False}}},
        {"id": "neg", "messages": CHAT, "sampling": {"temperature": -1}},
        {"id": "typo", "messages": CHAT, "sampling": {"max_token": 5}},
        {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": CHAT, "top_p": 7}},
    ])
    out = tmp_path / "out"
    proc = run_genq("enqueue", str(src), "--job", "samp", "--output", str(out), redis_url=redis_url, check=False)
    assert proc.returncode == 3
    assert "queued 1 prompt in" in proc.stdout
    by_line = {r.line: r.reason for r in _rejects(out / "samp" / "rejects" / "s.rejects.jsonl")}
    assert sorted(by_line) == [2, 3, 4]
    assert "'sampling': temperature must be >= 0, got -1" in by_line[2]
    assert "unknown request field 'max_token'" in by_line[3]
    assert "OpenAI Batch 'body': top_p must be <= 1, got 7" in by_line[4]
    assert "line 2: 'sampling': temperature" in proc.stderr


# ---------------------------------------------------------------- item 3: failed enqueues leave nothing


def test_missing_input_creates_no_job_and_locks_no_settings(redis_url, rconn, tmp_path):
    proc = run_genq("enqueue", str(tmp_path / "nope.jsonl"), "--job", "ghost", "--max-tokens", "10",
                    redis_url=redis_url, check=False)
    assert proc.returncode == 1 and "input file not found" in proc.stderr
    assert rconn.keys("*") == []
    src = tmp_path / "p.jsonl"
    write_prompts(src, 2)
    run_genq("enqueue", str(src), "--job", "ghost", "--max-tokens", "20", redis_url=redis_url)


def test_empty_input_is_an_error_and_creates_nothing(redis_url, rconn, tmp_path):
    src = tmp_path / "empty.jsonl"
    src.write_text("\n\n")
    proc = run_genq("enqueue", str(src), "--job", "empty", redis_url=redis_url, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no prompts" in proc.stderr and str(src) in proc.stderr
    assert rconn.keys("*") == []


def test_a_file_with_no_valid_line_is_a_plain_error_that_writes_nothing(redis_url, rconn, tmp_path):
    src = tmp_path / "binary"
    src.write_bytes(bytes(range(256)) * 64 + b"\n\x7fELF\x00\x01\n")
    out = tmp_path / "out"
    proc = run_genq("enqueue", str(src), "--job", "bin", "--output", str(out), redis_url=redis_url, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no valid line" in proc.stderr and "invalid JSON" in proc.stderr
    assert rconn.keys("*") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["binary"]


# ---------------------------------------------------------------- item 4: where rejects go


def test_rejects_go_under_the_job_output_and_keep_a_duplicate_id_line_whole(redis_url, tmp_path):
    first = {"id": "x", "messages": CHAT}
    dup = {"id": "x", "messages": [{"role": "user", "content": "other"}], "note": "keep me"}
    src = _lines(tmp_path / "in.jsonl", [first, "{broken", dup])
    out = tmp_path / "out"
    proc = run_genq("enqueue", str(src), "--job", "rj", "--output", str(out), redis_url=redis_url, check=False)
    assert proc.returncode == 3
    path = out / "rj" / "rejects" / "in.rejects.jsonl"
    assert str(path) in proc.stderr
    assert not (tmp_path / "in.rejects.jsonl").exists()
    rejects = {r.line: r for r in _rejects(path)}
    assert json.loads(rejects[3].text) == dup
    # A later enqueue of another line with that id: rejected against Redis, also kept whole.
    later = {"id": "x", "messages": [{"role": "user", "content": "third"}]}
    chosen = tmp_path / "elsewhere" / "r.jsonl"
    proc = run_genq("enqueue", str(_lines(tmp_path / "in2.jsonl", [later])), "--job", "rj",
                    "--rejects", str(chosen), redis_url=redis_url, check=False)
    assert proc.returncode == 3 and str(chosen) in proc.stderr
    (only,) = _rejects(chosen)
    assert json.loads(only.text) == later and "earlier enqueue" in only.reason


def test_rejects_of_an_s3_job_are_written_under_the_current_directory(tmp_path):
    from genq.producer.sources import default_rejects_path

    assert default_rejects_path("data/in.jsonl.gz", "s3://bucket/prefix", "j") == "genq-rejects/j/in.rejects.jsonl"
    assert default_rejects_path("s3://b/k/in.parquet", "/abs/out", "j") == "/abs/out/j/rejects/in.rejects.jsonl"


# ---------------------------------------------------------------- #10: concurrent enqueues of one input


def test_two_enqueues_of_one_input_at_once_queue_each_id_once(redis_url, rconn, tmp_path):
    src = tmp_path / "big.jsonl"
    ids = write_prompts(src, 5000)
    args = ["enqueue", str(src), "--job", "race", "--batch-size", "50", "--output", str(tmp_path / "out")]
    procs = [subprocess.Popen(genq_cmd(*args, redis_url=redis_url), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    queued = [p.id for p in _stored_prompts(rconn, "race")]
    assert sorted(queued) == ids
    assert int(rconn.hget(keys.job_stats("race"), "total")) == 5000
    assert rq_queue(rconn).count == rconn.zcard(keys.job_batches("race"))


# ---------------------------------------------------------------- item 3: genq jobs delete


def _job_keys(rconn, job: str) -> list[bytes]:
    return sorted(rconn.scan_iter(match=keys.job_keys_pattern(job)))


def test_jobs_delete_removes_every_key_of_the_job_and_its_rq_jobs(redis_url, rconn, tmp_path, sim, worker):
    from rq.job import Job

    def enqueue(job: str, n: int, *more: str) -> None:
        src = tmp_path / f"{job}.jsonl"
        write_prompts(src, n)
        run_genq("enqueue", str(src), "--job", job, "--batch-size", "2", "--max-tokens", "8",
                 "--output", str(tmp_path / "out"), *more, redis_url=redis_url)

    enqueue("gone", 6)
    # A worker finishes "gone": its done batches' RQ jobs leave RQ with their RELEASE.
    url = sim(max_running_requests=8, mean_output_tokens=4)
    assert worker(url, "--burst").wait(timeout=120) == 0
    enqueue("gone", 14, "--add")  # eight new prompts for the done job: four more batches, still queued
    enqueue("kept", 3)
    queue = rq_queue(rconn)
    # One of them failed in RQ (a stock `rq worker` ran it): the delete finds it in RQ's failed registry.
    failed = next(j for j in fetch_rq_jobs(rconn, queue.get_job_ids()) if j.args[0] == "gone")
    queue.remove(failed)
    queue.failed_job_registry.add(failed, ttl=600)
    gone_rq = [j.id for j in fetch_rq_jobs(rconn, [*queue.get_job_ids(), *queue.failed_job_registry.get_job_ids()])
               if j.args[0] == "gone"]
    assert len(gone_rq) == 4 and queue.finished_job_registry.count == 0

    no = subprocess.run(genq_cmd("jobs", "delete", "gone", redis_url=redis_url), input="n\n", capture_output=True,
                        text=True, timeout=60)
    assert no.returncode == 0 and "nothing deleted" in no.stdout, no.stdout + no.stderr  # a no is not an error
    assert _job_keys(rconn, "gone") and queue.count == 5

    proc = run_genq("jobs", "delete", "gone", "--yes", redis_url=redis_url)
    assert "removed job gone" in proc.stdout and "4 RQ jobs" in proc.stdout
    assert _job_keys(rconn, "gone") == []
    assert rconn.smembers(keys.JOBS) == {b"kept"}
    assert not any(rconn.exists(Job.key_for(i)) for i in gone_rq)
    assert queue.count == 2 and queue.failed_job_registry.count == 0  # kept's batches are untouched
    assert {j.args[0] for j in queue.get_jobs()} == {"kept"}
    assert _job_keys(rconn, "kept")
    again = run_genq("jobs", "delete", "gone", "--yes", redis_url=redis_url, check=False)
    assert again.returncode == 1 and "no job named 'gone'" in again.stderr


def test_jobs_delete_refuses_while_a_live_worker_holds_its_batches(redis_url, rconn, tmp_path):
    src = tmp_path / "p.jsonl"
    write_prompts(src, 4)
    run_genq("enqueue", str(src), "--job", "held", "--batch-size", "2", redis_url=redis_url)
    now = time.time()
    # A live worker's heartbeat as `genq worker` publishes it, holding one of the job's batches.
    status = WorkerStatus(name="w1", host="h", pid=1, server="http://x", state="busy", started_at=now,
                          heartbeat_at=now, batches=[BatchRef("held", "b0000001")])
    rconn.sadd(keys.WORKERS, "w1")
    rconn.set(keys.worker_status("w1"), pack(status), ex=60)
    proc = run_genq("jobs", "delete", "held", "--yes", redis_url=redis_url, check=False)
    assert proc.returncode == 1 and "w1" in proc.stderr and "--force" in proc.stderr
    assert _job_keys(rconn, "held")
    run_genq("jobs", "delete", "held", "--yes", "--force", redis_url=redis_url)
    assert _job_keys(rconn, "held") == [] and rq_queue(rconn).count == 0



def test_jobs_delete_held_by_a_silent_worker_says_what_helps(redis_url, rconn, tmp_path):
    """A killed worker holds its batches until its record expires: a drain cannot reach it (it said "Drain them")."""
    src = tmp_path / "p.jsonl"
    write_prompts(src, 2)
    run_genq("enqueue", str(src), "--job", "held", redis_url=redis_url)
    status = WorkerStatus(name="w9", host="h", pid=1, server="http://x", state="busy", started_at=time.time() - 300,
                          heartbeat_at=time.time() - 120, batches=[BatchRef("held", "b0000001")])
    rconn.sadd(keys.WORKERS, "w9")
    rconn.set(keys.worker_status("w9"), pack(status), ex=600)
    proc = run_genq("jobs", "delete", "held", "--yes", redis_url=redis_url, check=False)
    assert proc.returncode == 1 and "w9 (silent)" in proc.stderr and "genq drain" not in proc.stderr, proc.stderr
    assert "--force" in proc.stderr and "lost" in proc.stderr and _job_keys(rconn, "held"), proc.stderr

# ---------------------------------------------------------------- #10: URLs masked in every form


@pytest.mark.parametrize("url, masked", [
    ("redis://user:s3cret@h:6379/0", "redis://user:***@h:6379/0"),
    ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://s3cret@h:6379/0", "redis://***@h:6379/0"),
    ("rediss://default:s3cret@h.example:6380/2", "rediss://default:***@h.example:6380/2"),
    ("redis://h:6379/0?password=s3cret", "redis://h:6379/0?password=***"),
    ("redis://h:6379/0?db=1&password=s3cret&ssl_cert_reqs=none", "redis://h:6379/0?db=1&password=***&ssl_cert_reqs=none"),
    ("unix:///run/redis.sock?password=s3cret&db=3", "unix:///run/redis.sock?password=***&db=3"),
    ("unix://user:s3cret@/run/redis.sock", "unix://user:***@/run/redis.sock"),
    ("redis://u:p%40ss@h/0", "redis://u:***@h/0"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
])
def test_mask_url_hides_the_password_in_every_url_form(url, masked):
    assert mask_url(url) == masked
    assert "s3cret" not in mask_url(url)


def test_a_query_password_is_masked_in_enqueue_errors(tmp_path):
    src = tmp_path / "p.jsonl"
    write_prompts(src, 1)
    proc = run_genq("enqueue", str(src), "--job", "j", redis_url="redis://127.0.0.1:1/0?password=s3cret", check=False)
    assert proc.returncode == 1
    assert "s3cret" not in proc.stdout + proc.stderr and "password=***" in proc.stderr


# ---------------------------------------------------------------- items 7 and 8: README walk-through, exit codes


def test_the_readme_walkthrough_works_in_a_fresh_shell(tmp_path):
    """The "Using it" commands as printed, after its set-up line (the venv on PATH).

    Only the two ports are changed, to free ones, so parallel runs do not collide.
    """
    section = (ROOT / "README.md").read_text().split("## Using it", 1)[1]
    setup, script = re.findall(r"```\n(.*?)```", section, re.S)[:2]
    assert setup.strip() == "make install && . .venv/bin/activate"
    redis_port, sim_port = free_port(), free_port()
    script = script.replace("6390", str(redis_port)).replace("30000", str(sim_port))
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {k: v for k, v in os.environ.items() if k != "GENQ_REDIS_URL"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # what activate does
    shell = subprocess.Popen(["bash", "-e", "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = shell.communicate(timeout=240)
    finally:
        for pid in descendants(shell.pid):
            os.kill(pid, signal.SIGTERM)
        subprocess.run(["redis-cli", "-p", str(redis_port), "shutdown", "nosave"], capture_output=True)
    assert shell.returncode == 0, out
    assert "queued 20 prompts" in out and "6 'prompt' rows sent as one user message each" in out
    results = [json.loads(line) for line in (tmp_path / "example-results.jsonl").read_text().splitlines()]
    assert len(results) == 20 and all(r.get("completion") for r in results), results[:2]
    source = [json.loads(line) for line in (ROOT / "examples" / "prompts.jsonl").read_text().splitlines()]
    assert [r["id"] for r in results] == [row.get("id") or row.get("custom_id") for row in source]


def test_bad_usage_exits_2_as_the_help_says(redis_url, tmp_path):
    assert "2    bad usage" in run_genq("--help", redis_url=redis_url).stdout
    proc = run_genq("enqueue", "x.jsonl", "--job", "j", "--no-such-option", redis_url=redis_url, check=False)
    assert proc.returncode == 2 and "No such option" in proc.stderr
    assert "2 bad usage" in " ".join(run_genq("enqueue", "--help", redis_url=redis_url).stdout.split())


def test_an_openai_batch_lines_model_is_the_jobs_or_refused(redis_url, rconn, tmp_path):
    """A body's model was silently replaced by the job's. Now: a line naming another model than the job's
    --model is rejected, named; the same model (or none) is queued; with --model auto (nothing to check
    against at enqueue) it is queued and a note says which model the lines named and what is sent."""
    def line(cid, **body):
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {"messages": CHAT, **body}}

    src = _lines(tmp_path / "oai.jsonl", [line("same", model="m1"), line("other", model="gpt-4o-mini"),
                                         line("none"), line("odd", model=5)])
    proc = run_genq("enqueue", str(src), "--job", "pinned", "--model", "m1", "--output", str(tmp_path / "out"),
                    redis_url=redis_url, check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "line 2: OpenAI Batch body's 'model' 'gpt-4o-mini' is not the job's --model 'm1'" in proc.stderr
    assert "line 4: OpenAI Batch body's 'model' must be a string" in proc.stderr, proc.stderr
    assert [p.id for p in _stored_prompts(rconn, "pinned")] == ["same", "none"]
    proc = run_genq("enqueue", str(src), "--job", "auto", "--output", str(tmp_path / "out"), redis_url=redis_url,
                    check=False)
    assert proc.returncode == 3 and [p.id for p in _stored_prompts(rconn, "auto")] == ["same", "other", "none"]
    assert ("note: OpenAI Batch bodies name a model (gpt-4o-mini: 1 row, m1: 1 row); the job's (--model auto: "
            "the first server's) is sent instead") in proc.stdout, proc.stdout
    # A worker pins the job's model (as `jobs set --model` does here): the same command again queues the rest
    # as before, not rejecting the lines --model auto took.
    run_genq("jobs", "set", "auto", "--model", "m1", redis_url=redis_url)
    proc = run_genq("enqueue", str(src), "--job", "auto", "--output", str(tmp_path / "out"), redis_url=redis_url,
                    check=False)
    assert "skipped 3 prompts already queued" in proc.stdout and "--model" not in proc.stderr, proc.stdout + proc.stderr


def test_an_openai_batch_body_with_both_messages_and_prompt_is_rejected(redis_url, rconn, tmp_path):
    """The body's field its url does not take was dropped without a word (a plain row with both is refused)."""
    body = {"messages": CHAT, "prompt": "other"}
    chat = "/v1/chat/completions"
    src = _lines(tmp_path / "both.jsonl", [{"custom_id": "c", "url": chat, "body": body},
                                          {"custom_id": "p", "url": "/v1/completions", "body": body},
                                          {"custom_id": "ok", "url": chat, "body": {"messages": CHAT}}])
    proc = run_genq("enqueue", str(src), "--job", "both", "--output", str(tmp_path / "out"), redis_url=redis_url,
                    check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "line 1: has both 'messages' and 'prompt'; give one" in proc.stderr, proc.stderr
    assert "line 2: has both 'messages' and 'prompt'; give one" in proc.stderr, proc.stderr
    assert [p.id for p in _stored_prompts(rconn, "both")] == ["ok"]


def test_rejects_naming_the_input_is_refused_before_anything(redis_url, rconn, tmp_path):
    """--rejects INPUT wrote the rejected lines over the input itself; now bad usage, nothing queued."""
    src = _lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, "{bad"])
    before = src.read_bytes()
    proc = run_genq("enqueue", str(src), "--job", "rj", "--rejects", str(src), redis_url=redis_url, check=False)
    assert proc.returncode == 2 and "--rejects" in proc.stderr and "is the input" in proc.stderr, \
        proc.stdout + proc.stderr
    assert src.read_bytes() == before and rconn.keys("*") == []


def test_request_fields_beside_an_openai_batch_body_are_rejected(redis_url, rconn, tmp_path):
    """A batch line's 'sampling' (or messages, prompt) beside its body became metadata, never sent, without a
    word; its request is its body, so such a line is rejected, named."""
    line = {"custom_id": "r", "url": "/v1/chat/completions", "body": {"messages": CHAT}}
    src = _lines(tmp_path / "beside.jsonl", [{**line, "sampling": {"temperature": 0}},
                                            {**line, "custom_id": "m", "messages": CHAT},
                                            {**line, "custom_id": "ok", "topic": "t"}])
    proc = run_genq("enqueue", str(src), "--job", "beside", "--output", str(tmp_path / "out"), redis_url=redis_url,
                    check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "line 1: 'sampling' beside an OpenAI Batch 'body' would not be sent" in proc.stderr, proc.stderr
    assert "line 2: 'messages' beside an OpenAI Batch 'body' would not be sent" in proc.stderr, proc.stderr
    assert [(p.id, p.metadata) for p in _stored_prompts(rconn, "beside")] == [("ok", {"topic": "t"})]


def test_a_line_rejected_for_its_model_does_not_spoil_a_by_reference_batch(redis_url, rconn, tmp_path, sim, worker):
    """Workers reading a batch by reference take an id's first line in its range: a line rejected for its model
    followed by a line of the same id made the whole batch input_changed. Now the later line is rejected too."""
    def line(cid, model):
        return {"custom_id": cid, "body": {"model": model, "messages": CHAT, "max_tokens": 8}}

    src = _lines(tmp_path / "ref.jsonl", [line("s", "genq-sim/Sim-8B"), line("r", "other"),
                                         line("r", "genq-sim/Sim-8B")])
    out = tmp_path / "out"
    proc = run_genq("enqueue", str(src), "--job", "ref", "--model", "genq-sim/Sim-8B", "--input-by-reference",
                    "--output", str(out), redis_url=redis_url, check=False)
    assert proc.returncode == 3 and "line 3: duplicate id 'r' of a line rejected for its model" in proc.stderr, \
        proc.stdout + proc.stderr
    assert worker(sim(mean_output_tokens=4), "--burst").wait(timeout=120) == 0
    assert rconn.hlen(keys.job_dlq("ref")) == 0
    assert [json.loads(x)["id"] for x in (out / "ref" / "shards" / "b0000001.jsonl").read_text().splitlines()] == ["s"]


def test_a_parquet_rows_nan_setting_is_rejected_not_sent_as_null(redis_url, rconn, tmp_path):
    """A Parquet float column holds NaN, which JSON has not: the row's temperature went out as null."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "nan.parquet"
    pq.write_table(pa.table({"id": ["nan", "ok"], "prompt": ["a", "b"],
                             "sampling": [{"temperature": float("nan")}, {"temperature": 0.5}]}), src)
    proc = run_genq("enqueue", str(src), "--job", "nan", "--output", str(tmp_path / "out"), redis_url=redis_url,
                    check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "line 1: 'sampling': temperature must be a finite number, got nan" in proc.stderr, proc.stderr
    assert [(p.id, p.sampling) for p in _stored_prompts(rconn, "nan")] == [("ok", {"temperature": 0.5})]
