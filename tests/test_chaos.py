"""Chaos suite: faults in the server, workers killed, Redis restarted.

Every test ends with the same audit against the input: each valid prompt has
exactly one result or exactly one dead letter with a reason; none is lost,
none twice; nothing in the DLQ was caused by an outage or a kill.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import redis
from rq import Worker

from genq.core import keys
from genq.core.queueing import rq_queue
from genq.core.records import DeadLetter
from tests.audit import audit as shared_audit
from tests.conftest import enqueue, post_json, read_results, restart_port, run_genq, wait_until, write_prompts

FAST = dict(mean_output_tokens=120, output_sigma=1.0, tokens_per_step=16, step_ms_base=5)


def audit(conn: redis.Redis, out: Path, job: str, ids: list[str]) -> tuple[list[dict], dict[str, DeadLetter]]:
    """The shared exactly-once audit (tests/audit.py), returning the records and letters."""
    found = shared_audit(conn, job, out, ids)
    return list(found.results.values()), found.letters


def test_errors_resets_and_overlength_prompts(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=8, error_rate=0.25, reset_rate=0.1, context_length=400, **FAST)
    ids, out = enqueue(tmp_path, redis_url, "faults", 120, "--batch-size", "30", "--max-tokens", "200",
                       "--max-attempts", "8")
    # Three prompts too long for the context: the server rejects them (400), no retries.
    long_rows = [{"id": f"long{i}", "messages": [{"role": "user", "content": "word " * 600}]} for i in range(3)]
    extra = tmp_path / "long.jsonl"
    extra.write_text("".join(json.dumps(r) + "\n" for r in long_rows))
    run_genq("enqueue", str(extra), "--job", "faults", redis_url=redis_url)
    proc = worker(server, "--burst", "--retry-backoff", "0.05")
    assert proc.wait(timeout=180) == 0, proc.log()
    rows, letters = audit(rconn, out, "faults", ids + [r["id"] for r in long_rows])
    for i in range(3):
        letter = letters[f"long{i}"]
        assert letter.kind == "bad_request" and letter.status == 400 and letter.attempts == 1
        assert "longer than the model's context length" in letter.message
        assert letter.prompt is not None and letter.prompt.id == f"long{i}"
    # With 8 attempts at 25%+10% failure, any other letter must have used all its attempts (more, where
    # the server answered nothing sent after its first failure: no evidence yet that it is the prompt).
    for pid, letter in letters.items():
        if not pid.startswith("long"):
            assert letter.attempts >= 8 and letter.kind in ("server_error", "connection"), letter
    assert max(r["attempts"] for r in rows) > 1, "faults were injected, some prompts needed retries"


def test_hung_requests_are_cancelled_and_retried(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=8, hang_rate=0.15, **FAST)
    ids, out = enqueue(tmp_path, redis_url, "hangs", 60, "--batch-size", "30", "--max-tokens", "200")
    proc = worker(server, "--burst", "--stall-timeout", "1", "--retry-backoff", "0.05")
    assert proc.wait(timeout=180) == 0, proc.log()
    rows, letters = audit(rconn, out, "hangs", ids)
    assert not letters
    assert any(r["attempts"] > 1 for r in rows), "some requests hung and were retried"


def test_server_outage_burns_no_attempts_and_fills_no_dlq(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=8, mean_output_tokens=300, output_sigma=1.0, tokens_per_step=16,
                 step_ms_base=10)
    ids, out = enqueue(tmp_path, redis_url, "outage", 80, "--batch-size", "20", "--max-tokens", "1000",
                       "--max-attempts", "2")
    proc = worker(server, "--burst", "--retry-backoff", "0.05")
    done_key = keys.job_done("outage")
    wait_until(lambda: rconn.scard(done_key) >= 1, 60, "a first batch done")
    post_json(server + "/sim/faults", {"outage_for": 4})  # the server "crashes" for 4 s
    assert proc.wait(timeout=180) == 0, proc.log()
    rows, letters = audit(rconn, out, "outage", ids)
    assert not letters, f"an outage sent prompts to the DLQ: {letters}"
    assert all(r["attempts"] == 1 for r in rows), "attempts were counted while the server was down"
    log = proc.log()
    assert "is down: holding prompts" in log and "is back after" in log


def test_long_outage_hands_batches_back_to_other_gpus(redis_url, rconn, sim, worker, tmp_path):
    dying = sim(max_running_requests=4, mean_output_tokens=2000, output_sigma=0.3, tokens_per_step=16,
                step_ms_base=10)
    healthy = sim(max_running_requests=8, **FAST)
    ids, out = enqueue(tmp_path, redis_url, "handback", 40, "--batch-size", "10", "--max-tokens", "3000")
    first = worker(dying, "--server-down-timeout", "2", "--prefetch", "2", name="dying")
    wait_until(lambda: len(rq_queue(rconn).started_job_registry) == 2, 30, "two batches held")
    post_json(dying + "/sim/faults", {"outage_for": 600})
    wait_until(lambda: "handed back 2 batches" in first.log(), 30, "hand-back after the timeout")
    second = worker(healthy, "--burst", name="healthy")
    assert second.wait(timeout=120) == 0, second.log()
    first.signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0, first.log()
    rows, letters = audit(rconn, out, "handback", ids)
    assert not letters
    healthy_name = f"{socket.gethostname()}.{healthy.rsplit(':', 1)[1]}"
    assert sum(r["worker"] == healthy_name for r in rows) >= 20, "the handed-back batches ran elsewhere"


def test_sigterm_finishes_held_batches_and_exits_zero(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=8, mean_output_tokens=200, output_sigma=0.5, tokens_per_step=16,
                 step_ms_base=10)
    ids, out = enqueue(tmp_path, redis_url, "term", 100, "--batch-size", "20", "--max-tokens", "600")
    proc = worker(server)
    wait_until(lambda: rconn.scard(keys.job_done("term")) >= 1, 60, "a first batch done")
    proc.signal(signal.SIGTERM)
    # Up to the grace period (60 s by default) finishing its batches, then it hands back what is left.
    assert proc.wait(timeout=120) == 0, proc.log()
    done = {b.decode() for b in rconn.smembers(keys.job_done("term"))}
    held_left = len(rq_queue(rconn).started_job_registry)
    assert held_left == 0, "a drained worker holds nothing"
    # Whatever it finished is on disk; the rest is still queued, untouched.
    rows = read_results(out, "term")
    assert len(rows) == 20 * len(done)
    assert rq_queue(rconn).count == 5 - len(done)
    rest = worker(server, "--burst", name="rest")
    assert rest.wait(timeout=120) == 0, rest.log()
    audit(rconn, out, "term", ids)


def test_whole_worker_killed_is_recovered_by_rq_and_nothing_duplicates(redis_url, rconn, sim, worker, tmp_path):
    """SIGKILL to the worker: its alive key lapses and the reconciler queues its batches again."""
    server = sim(max_running_requests=8, mean_output_tokens=300, output_sigma=1.0, tokens_per_step=16,
                 step_ms_base=10)
    ids, out = enqueue(tmp_path, redis_url, "killall", 60, "--batch-size", "30", "--max-tokens", "1500")
    first = worker(server, name="first")
    wait_until(lambda: rconn.hlen(keys.batch_results("killall", "b0000001")) >= 5, 60, "results recorded")
    first.kill_tree()
    second = worker(server, "--burst", name="second")
    # The burst worker takes b2 if still queued; b1 comes back once the killed engine's alive key
    # lapses (genq.core.timings.LOST_BATCH_BACK_S).
    wait_until(lambda: rconn.scard(keys.job_done("killall")) == 2, 150, "both batches done")
    second.wait(timeout=60)
    rows, letters = audit(rconn, out, "killall", ids)
    assert not letters


def test_worker_survives_redis_restart(sim, procs, tmp_path):
    """A private Redis with appendonly, restarted mid-run: nothing lost, the worker carries on."""
    port = restart_port()
    data = tmp_path / "redis"
    data.mkdir()
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--appendonly", "yes",
            "--appendfsync", "always", "--save", "", "--dir", str(data)]
    server_proc = procs(args, name="redis")
    url = f"redis://127.0.0.1:{port}/0"
    conn = redis.Redis.from_url(url)
    wait_until(lambda: _pings(conn), 10, "private redis")
    sim_url = sim(max_running_requests=8, mean_output_tokens=200, output_sigma=0.8, tokens_per_step=16,
                  step_ms_base=10)
    src = tmp_path / "p.jsonl"
    ids = write_prompts(src, 80)
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "rr", "--output", str(out), "--batch-size", "20",
             "--max-tokens", "800", redis_url=url)
    proc = procs([sys.executable, "-m", "genq", "--redis", url, "worker", "--server", sim_url, "--burst"], name="w")
    wait_until(lambda: conn.scard(keys.job_done("rr")) >= 1, 60, "a first batch done")
    seen = proc.log().count("heartbeat: ")
    server_proc.signal(signal.SIGTERM)
    server_proc.wait(timeout=10)
    # Redis stays down until the worker has felt it: a heartbeat failed.
    wait_until(lambda: proc.log().count("heartbeat: ") > seen, 30, "the worker's heartbeat failing without Redis")
    procs(args, name="redis-again")
    wait_until(lambda: _pings(conn), 10, "redis back")
    assert proc.wait(timeout=180) == 0, proc.log()
    rows, letters = audit(conn, out, "rr", ids)
    assert not letters


def _pings(conn: redis.Redis) -> bool:
    try:
        return conn.ping()
    except redis.ConnectionError:
        return False


FROZEN_S = 25.0  # past its heartbeat (ALIVE_TTL_S = 10) and a reconciler pass or two: its batches go round again


def _holders(conn: redis.Redis, jobs: list[str]) -> set[str]:
    return {v.decode().split(" ", 1)[1].rsplit(".", 1)[0] for j in jobs for v in conn.hvals(keys.job_leases(j))
            if b" " in v}


def test_the_chaos_mix_is_exactly_once(redis_url, rconn, sim, worker, tmp_path):
    """#30's done-when: several jobs (batch sizes 1, 7 and 256), error and reset faults, a frozen
    holder (SIGSTOP past its heartbeat), a server crash, and stealing at the end of the big job
    (which comes last, to idle workers), in one run; every job audited. scripts/chaos_loop.sh
    runs it N times in a row under load."""
    faulty = sim(max_running_requests=8, error_rate=0.05, reset_rate=0.05, **FAST)
    steady = sim(max_running_requests=8, mean_output_tokens=200, output_sigma=0.8, tokens_per_step=16,
                 step_ms_base=8)
    crashing = sim(max_running_requests=8, **FAST)
    jobs = {}

    def add(job: str, n: int, size: int) -> None:
        jobs[job] = enqueue(tmp_path, redis_url, job, n, "--batch-size", str(size), "--max-tokens", "600",
                            "--max-attempts", "10")

    common = ("--retry-backoff", "0.05", "--prefetch", "2")
    procs = {}

    def start(name: str, url: str) -> None:
        procs[name] = worker(url, *common, "--name", name, name=name)

    # The frozen holder: "steady" starts alone and takes the small jobs' first batches; it stops
    # while it holds them, past its heartbeat (10 s); its alive key lapses, the reconcilers queue the
    # batches again, and it resumes to find them leased elsewhere. (Started beside the
    # others, it could miss holding anything: under load the small jobs were done in a second.)
    start("steady", steady)
    wait_until(lambda: len(Worker.all(connection=rconn)) >= 1, 60, "steady in rq info")
    add("one", 24, 1)
    add("seven", 70, 7)
    total_batches = {"one": 24, "seven": 10, "big": 2}

    def finished() -> int:
        return sum(rconn.scard(keys.job_done(j)) for j in jobs)

    def frozen_holding() -> bool:
        if "steady" not in _holders(rconn, list(jobs)):
            return False
        os.kill(procs["steady"].pid, signal.SIGSTOP)
        if "steady" in _holders(rconn, list(jobs)):
            return True
        os.kill(procs["steady"].pid, signal.SIGCONT)  # its batch got done in between: try again
        return False

    wait_until(frozen_holding, 60, "steady frozen while holding a batch")
    frozen_at = time.monotonic()
    try:
        start("faulty", faulty)
        start("crashing", crashing)
        wait_until(lambda: len(Worker.all(connection=rconn)) >= len(procs), 60, "every worker in rq info")
        post_json(crashing + "/sim/faults", {"outage_for": 4})  # the server crash
        wait_until(lambda: finished() >= 10, 120, "work going on without the frozen worker")
        time.sleep(max(0.0, FROZEN_S - (time.monotonic() - frozen_at)))
    finally:
        os.kill(procs["steady"].pid, signal.SIGCONT)
    wait_until(lambda: finished() == total_batches["one"] + total_batches["seven"], 300, "the small jobs done")
    # Stealing: the big job comes to idle workers, 2 requests in flight each, so its 256-prompt batch
    # outlasts the queue and the workers that hold nothing take prompts from its back.
    run_genq("concurrency", "2", "--all", redis_url=redis_url)
    add("big", 300, 256)
    wait_until(lambda: finished() == sum(total_batches.values()), 300, "every batch of every job done")
    # A job function that gave up on the frozen worker left its RQ job failed though the batch got done;
    # the reconcilers take such jobs out of RQ's failed registry (every 10 s).
    failed = rq_queue(rconn).failed_job_registry
    wait_until(lambda: not failed.get_job_ids(cleanup=False), 60, "RQ's failed registry cleared of done batches")
    for proc in procs.values():
        proc.signal(signal.SIGTERM)
    for name, proc in procs.items():
        assert proc.wait(timeout=90) == 0, f"{name}:\n{proc.log()}"
    for job, (ids, out) in jobs.items():
        rows, letters = audit(rconn, out, job, ids)
        assert not letters, f"{job}: dead letters with 10 attempts at 10% faults: {letters}"
    logs = "".join(p.log() for p in procs.values())
    assert "was frozen for" in procs["steady"].log(), "the frozen holder was not frozen past its heartbeat"
    assert "from another worker" in logs, "no prompt was taken from another worker's batch (stealing)"
