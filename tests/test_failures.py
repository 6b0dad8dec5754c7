"""End-to-end tests for the rows of the failure table that had none.

Each fault is real: the sim's own 503 queue limit, requests that run past the worker's
--request-timeout, a shard write failing with ENOSPC on a small tmpfs that is really
full, the Redis connections of a working worker dropped with CLIENT KILL. Real `genq
worker` processes throughout; every test ends with the shared exactly-once audit.

An SSE `error` event in the middle of a stream comes from the sim's stream_error fault, in
each engine's own shape (genq/sim/serve.py stream_error): SGLang's carries code 400 whatever
went wrong, vLLM's and llama.cpp's code 500, llama.cpp's stream ends without [DONE].
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from genq.core import keys
from tests.audit import audit
from tests.conftest import read_results, run_genq, sim_stats, wait_until, write_prompts

FAST = dict(mean_output_tokens=32, output_sigma=0.5, tokens_per_step=16, step_ms_base=5)


def enqueue(tmp_path: Path, job: str, n: int, *args: str, out: Path | None = None) -> tuple[list[str], Path]:
    src = tmp_path / f"{job}.jsonl"
    ids = write_prompts(src, n)
    out = out or tmp_path / "out"
    run_genq("enqueue", str(src), "--job", job, "--output", str(out), *args)
    return ids, out


def done_count(rconn, job: str) -> int:
    workers = [w.decode() for w in rconn.smembers(keys.job_workers(job))]
    return sum(int(rconn.hget(keys.worker_stats(job, w), "done") or 0) for w in workers)


def test_the_audit_catches_a_result_deleted_from_a_shard(redis_url, rconn, sim, worker, tmp_path):
    """The audit itself can fail: a result removed from a shard file is named as lost, and more."""
    server = sim(**FAST)
    ids, out = enqueue(tmp_path, "audited", 20, "--batch-size", "10", "--max-tokens", "64")
    proc = worker(server, "--burst")
    assert proc.wait(timeout=60) == 0, proc.log()
    audit(rconn, "audited", out, ids)  # the honest run passes

    shard = out / "audited" / "shards" / "b0000001.jsonl"
    lines = shard.read_text().splitlines(keepends=True)
    victim = json.loads(lines[3])["id"]
    shard.write_text("".join(lines[:3] + lines[4:]))
    with pytest.raises(AssertionError) as caught:
        audit(rconn, "audited", out, ids)
    message = str(caught.value)
    assert f"lost): ['{victim}']" in message, message
    assert "holds 9 records but its marker says 10" in message, message
    assert "workers' done counter is 20 but 19 are stored" in message, message
    assert "monitor says shard_records=20 but 19 stored" in message, message

    # ... and a duplicate: the line put back into the other shard.
    other = out / "audited" / "shards" / "b0000002.jsonl"
    other.write_text(other.read_text() + lines[3])
    with pytest.raises(AssertionError, match=r"prompt ids in the shards more than once|another job or batch"):
        audit(rconn, "audited", out, ids)


def test_queue_full_503_is_retried_until_every_prompt_completes(redis_url, rconn, sim, worker, tmp_path):
    # Two running, one waiting: the worker's window of 8 gets SGLang's 503 "The request queue is full."
    server = sim(max_running_requests=2, max_queued_requests=1, **FAST)
    ids, out = enqueue(tmp_path, "full", 40, "--batch-size", "20", "--max-tokens", "64", "--max-attempts", "100")
    proc = worker(server, "--burst", "--concurrency", "8", "--retry-backoff", "0.01", "--log-level", "debug")
    assert proc.wait(timeout=180) == 0, proc.log()
    found = audit(rconn, "full", out, ids)
    assert not found.letters, {k: v.message for k, v in found.letters.items()}
    # The sim injects no other fault: every extra attempt was a 503 for the full queue.
    assert [r for r in found.rows if r["attempts"] > 1], "no request was turned away: the queue limit was never reached"
    assert "The request queue is full." in proc.log()
    assert sum(sim_stats(server)["generated_by_key"].values()) == 40  # 503s generate nothing


STREAM_ERROR = "Internal server error (simulated, mid-stream)"


@pytest.mark.parametrize("flavor", ["sglang", "vllm", "llamacpp"])
def test_sse_error_event_mid_stream_is_retried_until_the_prompt_completes(flavor, redis_url, rconn, sim, worker,
                                                                          tmp_path):
    server = sim(flavor=flavor, max_running_requests=8, stream_error_rate=0.3, **FAST)
    job = f"sse-{flavor}"
    ids, out = enqueue(tmp_path, job, 40, "--batch-size", "20", "--max-tokens", "64", "--max-attempts", "10")
    proc = worker(server, "--burst", "--retry-backoff", "0.01", "--log-level", "debug")
    assert proc.wait(timeout=180) == 0, proc.log()
    found = audit(rconn, job, out, ids)
    assert not found.letters, {k: (v.kind, v.status, v.message) for k, v in found.letters.items()}
    retried = [r for r in found.rows if r["attempts"] > 1]
    assert retried, "no stream failed: the fault was never drawn"
    # The retried prompts' results are whole completions of a later attempt, not the failed
    # attempt's partial output.
    assert all(r["finish_reason"] in ("stop", "length") and r["completion"] for r in retried)
    assert f"failed (server_error: {STREAM_ERROR}); retry in" in proc.log()


def test_sse_error_event_on_every_attempt_is_dead_lettered_as_server_error(redis_url, rconn, sim, worker, tmp_path):
    # SGLang's flavor: its error event says code 400 although the request was accepted and ran. Most
    # requests fail (the draws are per prompt and attempt): the prompts that fail both attempts while
    # the server answers others are dead-lettered; a server failing every one would be its fault.
    server = sim(max_running_requests=8, stream_error_rate=0.6, **FAST)
    ids, out = enqueue(tmp_path, "sse-dead", 24, "--batch-size", "6", "--max-tokens", "64", "--max-attempts", "2")
    proc = worker(server, "--burst", "--retry-backoff", "0.01", "--log-level", "debug")
    assert proc.wait(timeout=180) == 0, proc.log()
    found = audit(rconn, "sse-dead", out, ids)
    assert found.results and found.letters, "the draws must give both outcomes"
    for pid, letter in found.letters.items():
        assert (letter.kind, letter.message) == ("server_error", STREAM_ERROR), letter
        # More than --max-attempts only while the server answered nothing sent since the prompt first
        # failed (no evidence against the prompt: docs/failures.md), and then the log says so.
        assert letter.attempts == 2 or (letter.attempts > 2 and f"prompt {pid} attempt 2 failed" in proc.log()
                                        and "no evidence it is the prompt's fault" in proc.log()), letter
    assert sim_stats(server)["aborted_requests"] >= 2 * len(found.letters), "each attempt reached the server"


def test_request_timeout_cancels_retries_then_dead_letters_as_timeout(redis_url, rconn, sim, worker, tmp_path):
    # Output lengths vary per prompt (deterministic, the same on every attempt) at 160 tokens/s:
    # short ones finish within the 1 s limit, long ones (up to --max-tokens 4000) cannot, on any attempt.
    server = sim(max_running_requests=24, mean_output_tokens=150, output_sigma=1.2, tokens_per_step=8,
                 step_ms_base=50, step_ms_per_req=0)
    ids, out = enqueue(tmp_path, "slow", 24, "--batch-size", "12", "--max-tokens", "4000", "--max-attempts", "2")
    proc = worker(server, "--burst", "--request-timeout", "1", "--retry-backoff", "0.05")
    assert proc.wait(timeout=180) == 0, proc.log()
    found = audit(rconn, "slow", out, ids)
    assert found.letters and found.results, "the lengths must give both outcomes"
    for letter in found.letters.values():
        assert letter.kind == "timeout" and letter.attempts == 2, letter
        assert "request exceeded 1s (request timeout)" in letter.message, letter.message
    # The server sees a cancelled request's connection close a moment after the worker has gone.
    wait_until(lambda: sim_stats(server)["aborted_requests"] >= 2 * len(found.letters), 10,
               "each attempt of a timed-out prompt cancelled at the server")


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs that can be filled to ENOSPC and freed again (needs root, as in the CI image)."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill needs root (the CI image runs tests as root)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(mnt: Path) -> Path:
    """Fill the filesystem to the last byte; return the filler file."""
    filler = mnt / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == 28, exc  # ENOSPC
        try:  # the last partial page
            while True:
                f.write(b"\0")
        except OSError as exc:
            assert exc.errno == 28, exc
    return filler


def on_a_full_disk(tmp_path: Path, disk: Path, job: str, n: int, server: str, worker):
    """A job whose output is on `disk`, filled; a --burst worker on it, once a shard write has
    failed with ENOSPC: (ids, output, the filler to unlink, the worker)."""
    out = disk / "out"
    out.mkdir()
    ids, _ = enqueue(tmp_path, job, n, "--batch-size", "10", "--max-tokens", "64", out=out)
    filler = fill(disk)
    proc = worker(server, "--burst", "--retry-backoff", "0.05", "--retry-backoff-max", "0.5")
    wait_until(lambda: "writing shard failed (OSError: [Errno 28] No space left on device" in proc.log(), 60,
               "a shard write failing with ENOSPC")
    return ids, out, filler, proc


def test_shard_write_failing_for_lack_of_disk_is_retried_and_acknowledged_after(redis_url, rconn, sim, worker,
                                                                               tmp_path, full_disk):
    from genq.core.queueing import rq_queue

    server = sim(**FAST)
    ids, out, filler, proc = on_a_full_disk(tmp_path, full_disk, "disk", 80, server, worker)
    # Said where a user looks, not only in the worker's log: its status (genq workers, the monitor).
    unwritten = "cannot write shards: [Errno 28] No space left on device ("
    wait_until(lambda: unwritten in run_genq("workers", "--json", redis_url=redis_url).stdout, 30,
               "genq workers --json saying why")
    assert unwritten[:55] in run_genq("workers", redis_url=redis_url).stdout  # its note column: 60 characters
    seen = " ".join(run_genq("monitor", "--job", "disk", "--once", redis_url=redis_url).stdout.split())
    assert unwritten in seen and "taking no new batch" in seen, seen
    # The batches it holds are generated into Redis; no new one is taken while none can be written
    # (their results would only pile up in Redis). No batch is acknowledged without its shard.
    held = lambda: {b for w in json.loads(run_genq("workers", "--json", redis_url=redis_url).stdout)  # noqa: E731
                    for b in w["batches"]}
    wait_until(lambda: done_count(rconn, "disk") == 10 * len(held()), 60, "the held batches' results in Redis")
    taken = held()
    seen = proc.log().count("No space left on device")
    wait_until(lambda: proc.log().count("No space left on device") > seen + 2, 60, "the worker retrying the write")
    assert held() == taken and done_count(rconn, "disk") == 10 * len(taken) and rq_queue(rconn).count > 0, \
        "a batch was taken while no shard could be written"
    assert rconn.scard(keys.job_done("disk")) == 0, "a batch was acknowledged without its shard"
    assert not list(out.rglob("*.jsonl")), "a shard is on the full disk"
    filler.unlink()  # room again
    assert proc.wait(timeout=120) == 0, proc.log()
    found = audit(rconn, "disk", out, ids)
    assert not found.letters and len(found.rows) == 80
    assert not [p for p in (out / "disk").rglob(".*.tmp")], "a half-written temporary file was left behind"


def test_a_job_whose_shards_cannot_be_written_does_not_hold_up_another(redis_url, rconn, sim, worker, tmp_path,
                                                                       full_disk):
    """The brake is the job's: a worker whose shards of one job cannot be written (its output on a
    full disk) puts that job's batches back and goes on with another job written elsewhere."""
    server = sim(**FAST)
    stuck, stuck_out, filler, proc = on_a_full_disk(tmp_path, full_disk, "stuck", 60, server, worker)
    free, free_out = enqueue(tmp_path, "free", 60, "--batch-size", "10", "--max-tokens", "64")
    wait_until(lambda: rconn.scard(keys.job_done("free")) == 6, 90, "the other job written whole")
    assert rconn.scard(keys.job_done("stuck")) == 0 and proc.alive(), proc.log()
    filler.unlink()
    assert proc.wait(timeout=120) == 0, proc.log()
    assert len(audit(rconn, "stuck", stuck_out, stuck).rows) == 60
    assert len(audit(rconn, "free", free_out, free).rows) == 60
    assert sum(sim_stats(server)["generated_by_key"].values()) == 120


def test_redis_connections_dropped_mid_commit_leave_results_exactly_once(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=8, mean_output_tokens=48, output_sigma=0.5, tokens_per_step=8, step_ms_base=5)
    ids, out = enqueue(tmp_path, "drops", 200, "--batch-size", "25", "--max-tokens", "200")
    proc = worker(server, "--burst", "--retry-backoff", "0.05")
    kills = 0
    last = 0
    while proc.alive() and kills < 6:
        # Each drop comes once the worker has committed more results since the last one.
        try:
            wait_until(lambda last=last: not proc.alive() or done_count(rconn, "drops") >= last + 15, 60,
                       "more results committed")
        except AssertionError:
            break
        last = done_count(rconn, "drops")
        if last >= 200:
            break
        killed = rconn.execute_command("CLIENT", "KILL", "TYPE", "normal")  # every client but this test's
        assert killed >= 1
        kills += 1
    assert kills >= 3, f"only {kills} drops happened before the job finished: make it longer"
    assert proc.wait(timeout=180) == 0, proc.log()
    found = audit(rconn, "drops", out, ids)
    assert not found.letters, "dropped Redis connections sent prompts to the DLQ"
    assert sorted(r["id"] for r in read_results(out, "drops")) == ids
