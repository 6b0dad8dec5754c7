"""Exactly once with any number of holders: several jobs at once, frozen workers,
duplicate deliveries, lost RQ jobs, shutdown mid-batch, a prompt that crashes its server.

Each test ends with the same check against the input: one record per prompt in the
output (or one dead letter the prompt caused), the counters equal to the records,
and RQ holding nothing of the job.
"""

from __future__ import annotations

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
from tests.conftest import read_results, run_genq, sim_stats, wait_until, write_prompts

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
    os.kill(frozen.pid, signal.SIGSTOP)  # past its heartbeat: its lease lapses, the reconciler queues the batch again
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
    from rq import SimpleWorker
    from rq.serializers import JSONSerializer

    from genq.core import ledger

    monkeypatch.setattr(ledger, "STRANDED_CONFIRM_S", 0.0)
    ids, out = enqueue(tmp_path, "tf", 10, "--batch-size", "10", "--max-tokens", "200")
    reconciler = ledger.Reconciler(rconn, "test")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    # a stock RQ worker (in this process: no interpreter to start): run_batch refuses, the job fails
    for _ in range(12):
        try:
            SimpleWorker([keys.QUEUE], connection=rconn, serializer=JSONSerializer).work(burst=True)
        finally:
            for sig, handler in handlers.items():  # RQ's own, for its warm/cold shutdown
                signal.signal(sig, handler)
        assert rq_queue(rconn).count == 0
        assert reconciler.pass_once(force=True).requeued == [("tf", "b0000001")]  # stranded: queued again
    assert json.loads(run_genq("dlq", "list", "--json").stdout) == [], "a failed transport is in the DLQ"
    server = sim(max_running_requests=8, **FAST)
    proc = worker(server, "--burst")
    assert proc.wait(timeout=60) == 0, proc.log()
    check(rconn, out, "tf", ids)
    assert int(rconn.hget(keys.job_stats("tf"), "redeliveries")) == 12


def test_a_job_stuck_between_dequeue_and_start_is_brought_back(redis_url, rconn, sim, worker, tmp_path):
    """A stock RQ worker (or a genq worker of an older version) that dies right after moving a job
    to RQ's intermediate list leaves it there, "queued", where no engine's TAKE looks: the
    reconciler brings it back."""
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


def test_a_batch_started_by_a_live_engine_that_holds_no_lease_is_stranded(redis_url, rconn, sim, worker, tmp_path):
    """RQ says "started" by a live engine, but the ledger has no lease of it for the batch (TAKE
    writes both at once: only a Redis restored between them, or a foreign writer, does this): the
    reconciler must not trust RQ's word alone, nor wait for RQ's abandoned-job detection."""
    server = sim(max_running_requests=8, **FAST)
    ids, out = enqueue(tmp_path, "ghost", 10, "--batch-size", "10", "--max-tokens", "400")
    queue = rq_queue(rconn)
    rq_id = rconn.hget(keys.job_transport("ghost"), "b0000001").decode()
    queue.remove(rq_id)
    proc = worker(server, name="alive")
    instance = wait_until(lambda: next((k.decode().split(":")[2] for k in rconn.keys("genq:engine:*:alive")), None),
                          30, "the engine's heartbeat")
    rq_job = RqJob.fetch(rq_id, connection=rconn, serializer=queue.serializer)
    rconn.hset(rq_job.key, mapping={"status": "started", "worker_name": instance})
    wait_until(lambda: rconn.scard(keys.job_done("ghost")) == 1, 60, "the stranded batch done")
    assert "batch ghost/b0000001 had no live RQ job" in proc.log()
    proc.signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.log()
    check(rconn, out, "ghost", ids)


def test_held_batches_are_started_in_rq_for_as_long_as_they_are_held(redis_url, rconn, sim, worker, tmp_path):
    """The engine is one RQ worker in `rq info`; each batch it holds is an RQ job started by it,
    with no expiry in RQ's started registry (the ledger's lease decides, not RQ's clock), so RQ's
    own cleanup (run by every `rq info`) never fails a long batch; done, it leaves RQ."""
    from rq import Worker

    server = sim(max_running_requests=4, mean_output_tokens=3000, output_sigma=0.2, tokens_per_step=2,
                 step_ms_base=40)  # a minute a prompt: the batches outlive the look
    enqueue(tmp_path, "kept", 8, "--batch-size", "4", "--max-tokens", "5000")
    proc = worker(server, "--prefetch", "2")
    wait_until(lambda: rconn.hlen(keys.job_leases("kept")) == 2, 60, "both batches held")
    registry = StartedJobRegistry(queue=rq_queue(rconn))
    held = {v.decode() for v in rconn.hvals(keys.job_transport("kept"))}
    assert {i.split(":")[0] for i in registry.get_job_ids(cleanup=True)} == held  # RQ's cleanup ran: kept
    assert all(score == float("inf") for _, score in rconn.zrange(registry.key, 0, -1, withscores=True))
    workers = Worker.all(connection=rconn)
    instance = rconn.hget(keys.job_leases("kept"), "b0000001").decode().split()[1]
    assert [w.name for w in workers] == [instance]
    assert {RqJob.fetch(i, connection=rconn).worker_name for i in held} == {instance}
    proc.signal(signal.SIGKILL)  # the batches are not the point here
