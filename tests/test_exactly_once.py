"""Exactly once with any number of holders: several jobs at once, frozen workers,
duplicate deliveries, lost RQ jobs, shutdown mid-batch, a prompt that crashes its server.

Each test ends with the same check against the input: one record per prompt in the
output (or one dead letter the prompt caused), the counters equal to the records,
and RQ holding nothing of the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import redis
from rq.job import Job as RqJob
from rq.registry import StartedJobRegistry

from genq.core import keys
from genq.core.queueing import enqueue_batch_jobs, rq_queue
from genq.core.records import DeadLetter
from genq.sim.lengths import prompt_key
from tests.audit import audit
from tests.conftest import descendants, read_results, run_genq, sim_stats, wait_until, write_prompts

FAST = dict(mean_output_tokens=120, output_sigma=1.0, tokens_per_step=16, step_ms_base=5)
SLOW = dict(mean_output_tokens=600, output_sigma=0.5, tokens_per_step=8, step_ms_base=20)


def enqueue(tmp_path: Path, job: str, n: int, *args: str, start: int = 0) -> tuple[list[str], Path]:
    src = tmp_path / f"{job}.jsonl"
    ids = write_prompts(src, n, start=start)
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", job, "--output", str(out), *args)
    return ids, out


def check(conn: redis.Redis, out: Path, job: str, ids: list[str]) -> tuple[list[dict], dict[str, DeadLetter]]:
    """The shared exactly-once audit (tests/audit.py: output, letters, counters, monitor, RQ),
    returning the records and the letters."""
    found = audit(conn, job, out, ids)
    return list(found.results.values()), found.letters


def test_several_jobs_with_the_same_batch_ids_in_one_worker(redis_url, rconn, sim, worker, tmp_path):
    """Every job numbers its batches from b0000001: the second and third job used to be
    answered "done" without running, and the burst worker left."""
    server = sim(max_running_requests=16, **FAST)
    jobs = {}
    for j, n in (("g4", 40), ("g5", 40), ("g6", 25)):
        jobs[j] = enqueue(tmp_path, j, n, "--batch-size", "10", "--max-tokens", "400", start=len(jobs) * 1000)
    proc = worker(server, "--burst")
    assert proc.wait(timeout=120) == 0, proc.log()
    for j, (ids, out) in jobs.items():
        check(rconn, out, j, ids)


def test_several_jobs_across_two_workers(redis_url, rconn, sim, worker, tmp_path):
    a, b = sim(max_running_requests=8, **FAST), sim(max_running_requests=8, **FAST)
    jobs = {j: enqueue(tmp_path, j, 30, "--batch-size", "5", "--max-tokens", "400", start=i * 1000)
            for i, j in enumerate(("x1", "x2", "x3"))}
    first, second = worker(a, "--burst", name="wa"), worker(b, "--burst", name="wb")
    assert first.wait(timeout=120) == 0, first.log()
    assert second.wait(timeout=120) == 0, second.log()
    for j, (ids, out) in jobs.items():
        check(rconn, out, j, ids)


def test_a_deleted_rq_job_is_brought_back_by_the_reconciler(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=8, **FAST)
    ids, out = enqueue(tmp_path, "lost", 30, "--batch-size", "10", "--max-tokens", "400")
    victim = rconn.hget(keys.job_transport("lost"), "b0000002").decode()
    queue = rq_queue(rconn)
    queue.remove(victim)
    RqJob.fetch(victim, connection=rconn, serializer=queue.serializer).delete()
    assert queue.count == 2
    proc = worker(server, "--burst")
    assert proc.wait(timeout=120) == 0, proc.log()
    assert "batch lost/b0000002 had no live RQ job" in proc.log()
    check(rconn, out, "lost", ids)


def test_a_duplicate_rq_delivery_mid_run_changes_nothing(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=6, **SLOW)
    ids, out = enqueue(tmp_path, "dup", 24, "--batch-size", "12", "--max-tokens", "2000")
    proc = worker(server, "--burst", "--prefetch", "2")
    wait_until(lambda: rconn.hlen(keys.batch_results("dup", "b0000001")) >= 2, 60, "the first batch under way")
    with rconn.pipeline(transaction=True) as pipe:  # RQ delivers the same batch a second time
        enqueue_batch_jobs(pipe, rconn, [("dup", "b0000001", 12)], at_front=True)
        pipe.execute()
    assert proc.wait(timeout=180) == 0, proc.log()
    rows, _ = check(rconn, out, "dup", ids)
    generated = sim_stats(server)["generated_by_key"]
    recorded_once = [r["id"] for r in rows if generated[prompt_key(r["messages"])] == 1]
    assert len(recorded_once) >= len(ids) - 6, "prompts already recorded were sent again"


def test_a_frozen_worker_resumed_after_another_finished_its_batches(redis_url, rconn, sim, worker, tmp_path):
    slow = sim(max_running_requests=4, **SLOW)
    fast = sim(max_running_requests=16, **FAST)
    ids, out = enqueue(tmp_path, "frz", 40, "--batch-size", "10", "--max-tokens", "2000")
    frozen = worker(slow, "--prefetch", "2", name="frozen")
    wait_until(lambda: rconn.hlen(keys.batch_results("frz", "b0000001")) >= 1, 60, "the frozen worker under way")
    os.kill(frozen.pid, signal.SIGSTOP)  # the engine only, past its heartbeat: its RQ loops give up on it
    try:
        helper = worker(fast, "--burst", name="helper")
        assert helper.wait(timeout=180) == 0, helper.log()
        check(rconn, out, "frz", ids)
        before = {r["id"]: r for r in read_results(out, "frz")}
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    wait_until(lambda: "elsewhere: dropping it here" in frozen.log(), 30, "the resumed worker to let go")
    frozen.signal(signal.SIGTERM)
    assert frozen.wait(timeout=60) == 0, frozen.log()
    rows, _ = check(rconn, out, "frz", ids)
    assert {r["id"]: r for r in rows} == before, "the resumed worker changed a published shard"


def test_sigterm_with_a_grace_period_shorter_than_the_batches(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=4, **SLOW)
    ids, out = enqueue(tmp_path, "term", 24, "--batch-size", "12", "--max-tokens", "2000")
    proc = worker(server, "--prefetch", "2", "--grace-period", "1")
    wait_until(lambda: rconn.hlen(keys.batch_results("term", "b0000001")) >= 1, 60, "work under way")
    proc.signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.log()
    log = proc.log()
    assert "handed back" in log and "exited:" in log
    assert "cold shut down" not in log.lower() and "Traceback" not in log
    assert len(StartedJobRegistry(queue=rq_queue(rconn))) == 0, "a handed-back batch is still 'started' in RQ"
    finisher = worker(server, "--burst", name="finisher")
    assert finisher.wait(timeout=180) == 0, finisher.log()
    check(rconn, out, "term", ids)


def test_a_prompt_that_crashes_its_server_is_dead_lettered_with_the_evidence(redis_url, rconn, sim, worker,
                                                                             tmp_path):
    server = sim(max_running_requests=8, crash_marker="CRASH-ME", outage_for=0.5, **FAST)
    src = tmp_path / "crash.jsonl"
    ids = write_prompts(src, 30)
    with open(src, "a") as f:
        f.write(json.dumps({"id": "poison", "messages": [{"role": "user", "content": "please CRASH-ME now"}]}) + "\n")
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "crash", "--output", str(out), "--batch-size", "31",
             "--max-tokens", "400", "--max-attempts", "2")
    proc = worker(server, "--burst", "--retry-backoff", "0.05")
    assert proc.wait(timeout=180) == 0, proc.log()
    rows, letters = check(rconn, out, "crash", ids + ["poison"])
    assert list(letters) == ["poison"], f"only the poison prompt is dead-lettered: {letters}"
    letter = letters["poison"]
    assert letter.kind == "server_crash" and "went down 3 times" in letter.message
    assert len(rows) == 30


def test_records_are_not_rewritten_by_a_late_second_writer(redis_url, rconn, sim, worker, tmp_path):
    """Two workers racing on one batch (both hold it): the shard is built from Redis, so
    whichever writes last writes the same bytes; the marker too."""
    server = sim(max_running_requests=8, **FAST)
    ids, out = enqueue(tmp_path, "race", 20, "--batch-size", "20", "--max-tokens", "400")
    with rconn.pipeline(transaction=True) as pipe:
        enqueue_batch_jobs(pipe, rconn, [("race", "b0000001", 20)])
        pipe.execute()
    a = worker(server, "--burst", "--name", "ra", name="ra")
    b = worker(server, "--burst", "--name", "rb", name="rb")
    assert a.wait(timeout=120) == 0 and b.wait(timeout=120) == 0, a.log() + b.log()
    check(rconn, out, "race", ids)
    shard = out / "race" / "shards" / "b0000001.jsonl"
    marker = out / "race" / "manifest" / "b0000001.json"
    info = json.loads(marker.read_text())
    assert info["bytes"] == shard.stat().st_size and info["records"] == 20
    assert info["at"] == max(r["finished_at"] for r in read_results(out, "race")), "marker time not deterministic"


def test_transport_failures_never_count_against_the_batch(redis_url, rconn, sim, worker, tmp_path, monkeypatch):
    """RQ used to retry a batch 10 times and then dead-letter it as batch_failed, though no
    prompt was at fault: the ledger now queues it again however often its RQ job fails."""
    import subprocess
    import sys

    from genq.core import ledger

    monkeypatch.setattr(ledger, "STRANDED_CONFIRM_S", 0.0)
    ids, out = enqueue(tmp_path, "tf", 10, "--batch-size", "10", "--max-tokens", "200")
    reconciler = ledger.Reconciler(rconn, "test")
    rq_bin = str(Path(sys.executable).parent / "rq")
    env = {k: v for k, v in os.environ.items() if k != "GENQ_ENGINE"}
    for _ in range(12):  # a stock RQ worker: run_batch raises EngineLost, the RQ job fails
        subprocess.run([rq_bin, "worker", "--burst", "-S", "rq.serializers.JSONSerializer", "--url", redis_url,
                        keys.QUEUE], env=env, capture_output=True, timeout=60, check=True)
        assert rq_queue(rconn).count == 0
        assert reconciler.pass_once(force=True).requeued == [("tf", "b0000001")]  # stranded: queued again
    assert json.loads(run_genq("dlq", "list", "--json").stdout) == [], "a failed transport is in the DLQ"
    server = sim(max_running_requests=8, **FAST)
    proc = worker(server, "--burst")
    assert proc.wait(timeout=60) == 0, proc.log()
    check(rconn, out, "tf", ids)
    assert int(rconn.hget(keys.job_stats("tf"), "redeliveries")) == 12


def test_a_job_stuck_between_dequeue_and_start_is_brought_back(redis_url, rconn, sim, worker, tmp_path):
    """An RQ loop that dies (Redis restarting under it) right after moving a job to RQ's
    intermediate list leaves it there, "queued", until a running loop's cleanup: a burst
    worker, whose loops have left, used to wait for it forever."""
    server = sim(max_running_requests=8, **FAST)
    ids, out = enqueue(tmp_path, "mid", 20, "--batch-size", "10", "--max-tokens", "400")
    queue = rq_queue(rconn)
    stuck = rconn.lmove(queue.key, queue.intermediate_queue_key, "LEFT", "RIGHT")
    assert stuck is not None and queue.count == 1
    proc = worker(server, "--burst")
    assert proc.wait(timeout=120) == 0, proc.log()
    assert "had no live RQ job" in proc.log()
    check(rconn, out, "mid", ids)
    assert rconn.llen(queue.intermediate_queue_key) == 0


def test_a_batch_started_by_a_loop_that_died_before_handing_it_over(redis_url, rconn, sim, worker, tmp_path):
    """RQ says "started" by a loop of a live engine, but the loop died (Redis went away
    under it) before the engine got the batch: no lease, so the batch is stranded, and
    the reconciler must not wait for RQ's abandoned-job detection (minutes) to see it."""
    server = sim(max_running_requests=8, **FAST)
    ids, out = enqueue(tmp_path, "ghost", 10, "--batch-size", "10", "--max-tokens", "400")
    queue = rq_queue(rconn)
    rq_id = rconn.hget(keys.job_transport("ghost"), "b0000001").decode()
    queue.remove(rq_id)  # a loop took it...
    proc = worker(server, name="alive")
    instance = wait_until(lambda: next((k.decode().split(":")[2] for k in rconn.keys("genq:engine:*:alive")), None),
                          30, "the engine's heartbeat")
    rq_job = RqJob.fetch(rq_id, connection=rconn, serializer=queue.serializer)
    rconn.hset(rq_job.key, mapping={"status": "started", "worker_name": f"{instance}.dead"})  # ...and died
    wait_until(lambda: rconn.scard(keys.job_done("ghost")) == 1, 60, "the stranded batch done")
    assert "batch ghost/b0000001 had no live RQ job" in proc.log()
    proc.signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.log()
    check(rconn, out, "ghost", ids)


def test_rq_loops_killed_mid_batch_leave_nothing_started_in_rq(redis_url, rconn, sim, worker, tmp_path):
    """An RQ loop that dies running its batch's job (seen: a loop crashing on a Redis outage)
    leaves its job "started" in RQ after the engine finished the batch; before leaving, the burst
    worker's reconciler clears it, so `rq info` does not show a done batch as running."""
    server = sim(max_running_requests=4, **SLOW)
    ids, out = enqueue(tmp_path, "ld", 16, "--batch-size", "8", "--max-tokens", "2000")
    proc = worker(server, "--burst", "--prefetch", "2")
    wait_until(lambda: rconn.hlen(keys.job_leases("ld")) == 2, 60, "both batches held")
    loops = _rq_loops(proc.pid)
    assert loops, "no RQ loop found"
    for pid in loops:
        with contextlib.suppress(ProcessLookupError):  # a loop may have just left
            os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=180) == 0, proc.log()
    check(rconn, out, "ld", ids)
    assert "left started by an RQ loop that died running it" in proc.log(), proc.log()


def test_loops_run_their_batches_without_a_work_horse_and_keep_them_alive_in_rq(
        redis_url, rconn, sim, worker, tmp_path):
    """#29: a forked work horse per batch cost a fork and RQ's horse bookkeeping for a job
    function that only waits. The loops run it themselves (rq.SimpleWorker), and keep RQ's
    heartbeats of the loop, the job and its execution going while it waits, as a forked
    worker's parent did: a long batch is never taken for abandoned by `rq info` or RQ."""
    server = sim(max_running_requests=4, mean_output_tokens=3000, output_sigma=0.2, tokens_per_step=2,
                 step_ms_base=40)  # a minute a prompt: the batches outlive the look
    enqueue(tmp_path, "kept", 8, "--batch-size", "4", "--max-tokens", "5000")
    proc = worker(server, "--prefetch", "2", "--heartbeat-interval", "1")
    wait_until(lambda: rconn.hlen(keys.job_leases("kept")) == 2, 60, "both batches held")
    loops = _rq_loops(proc.pid)
    assert loops and all(not descendants(pid) for pid in loops), "a loop forked a work horse"
    registry = StartedJobRegistry(queue=rq_queue(rconn))

    def beats() -> tuple[dict, dict]:
        running = dict(rconn.zrange(registry.key, 0, -1, withscores=True))
        loop_beats = {w.name: rconn.hget(w.key, "last_heartbeat") for w in _rq_workers(rconn) if w.get_current_job_id()}
        return running, loop_beats

    first_running, first_loops = beats()
    assert len(first_running) == 2 and len(first_loops) == 2, (first_running, first_loops)

    def renewed() -> bool:
        running, loop_beats = beats()
        assert running.keys() == first_running.keys(), "a batch ended during the look"
        return all(running[e] > first_running[e] for e in running) and all(
            loop_beats[n] != first_loops[n] for n in first_loops)

    wait_until(renewed, 20, "RQ's heartbeats of both running batches and their loops, renewed")
    proc.signal(signal.SIGKILL)  # the engine: its loops die with it; the batches are not the point here


def test_a_loop_stopped_as_it_takes_a_batch_hands_the_batch_back(redis_url, rconn, sim, worker, tmp_path):
    """RQ's stop signal raises at once in a loop that is not busy. Landing after the loop's BLMOVE
    took a batch into RQ's intermediate list, and before the job started, it stranded the batch
    there (seen in test_chaos's SIGTERM test, where the signal comes as a loop goes back for its
    next batch). Made exact here: the loops are frozen in their BLMOVE, a batch is queued (Redis
    serves a frozen BLMOVE), the worker is told to stop, and the loops resume with that pending."""
    server = sim(max_running_requests=8, **FAST)
    proc = worker(server)
    queue = rq_queue(rconn)
    wait_until(lambda: _rq_loops(proc.pid) and len(_rq_workers(rconn)) == len(_rq_loops(proc.pid))
               and all(w.get_state() == "idle" for w in _rq_workers(rconn)), 30, "the RQ loops waiting for a batch")
    loops = _rq_loops(proc.pid)
    for pid in loops:
        os.kill(pid, signal.SIGSTOP)
    ids, out = enqueue(tmp_path, "stop", 10, "--batch-size", "10", "--max-tokens", "400")
    wait_until(lambda: rconn.llen(queue.intermediate_queue_key) == 1, 30, "a frozen loop's BLMOVE served")
    proc.signal(signal.SIGTERM)
    wait_until(lambda: all(_sigterm_pending(pid) for pid in loops), 30, "the engine's SIGTERM pending in every loop")
    for pid in loops:
        os.kill(pid, signal.SIGCONT)
    assert proc.wait(timeout=60) == 0, proc.log()
    assert rconn.llen(queue.intermediate_queue_key) == 0, "the batch was left in RQ's intermediate list"
    # The engine either ran the batch it got while stopping, or handed it back: done or queued.
    assert queue.count + rconn.scard(keys.job_done("stop")) == 1, proc.log()
    rest = worker(server, "--burst", name="rest")
    assert rest.wait(timeout=120) == 0, rest.log()
    check(rconn, out, "stop", ids)


def _rq_loops(engine_pid: int) -> list[int]:
    """The engine's RQ loops: its child processes here (the server is external). Not by command
    line: RQ renames its processes (rq:worker:...) where setproctitle is installed."""
    try:
        return [int(c) for c in Path(f"/proc/{engine_pid}/task/{engine_pid}/children").read_text().split()]
    except OSError:
        return []


def _rq_workers(conn: redis.Redis) -> list:
    from rq import Worker

    return Worker.all(connection=conn)


def _sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM sent to the (stopped) process waits for it."""
    status = Path(f"/proc/{pid}/status").read_text()
    pending = int(next(line.split()[1] for line in status.splitlines() if line.startswith("ShdPnd:")), 16)
    return bool(pending & (1 << (signal.SIGTERM - 1)))

