"""genq dlq against real dead letters: real Redis, `genq sim`, `genq worker` and a plain `rq worker`.

Dead prompts come from the sim's SGLang 400 for prompts longer than a small
--context-length; failed batches from a plain `rq worker --burst`, whose run_batch refuses each genq batch
(genq's engine takes batches itself).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

from rq.job import Job as RqJob
from rq.registry import FailedJobRegistry

from genq.core import keys
from genq.core.queueing import rq_queue
from genq.core.records import JobConfig, Result, Usage, unpack
from genq.core.redisconn import connect_async
from genq.worker.results import ResultWriter
from tests.audit import audit
from tests.conftest import ROOT, genq_cmd, read_results, run_genq, sim_stats, wait_until

FAST_SIM = dict(mean_output_tokens=16, output_sigma=0.5, tokens_per_step=16, step_ms_base=2)
SMALL_CONTEXT = 256
TOO_LONG = re.compile(r"^The input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)\.$")








def write_mixed(path: Path, n: int, long_every: int = 4) -> tuple[list[str], list[str]]:
    """n prompts; every long_every-th (from 1) is ~500 sim tokens, over SMALL_CONTEXT. Returns (all, long) ids."""
    ids, long_ids = [], []
    with open(path, "w") as f:
        for i in range(n):
            pid = f"p{i:05d}"
            is_long = i % long_every == 1
            content = ("x" * 2000 + f" {i}") if is_long else f"prompt number {i}"
            f.write(json.dumps({"id": pid, "messages": [{"role": "user", "content": content}]}) + "\n")
            ids.append(pid)
            if is_long:
                long_ids.append(pid)
    return ids, long_ids


def dlq_json(redis_url: str, *args: str) -> list[dict]:
    return json.loads(run_genq("dlq", "list", "--json", *args, redis_url=redis_url).stdout)


def enqueue(redis_url: str, src: Path, job: str, out: Path, batch_size: int = 5) -> None:
    run_genq("enqueue", str(src), "--job", job, "--batch-size", str(batch_size), "--max-tokens", "16",
             "--output", str(out), redis_url=redis_url)


def dead_letters_the_real_way(redis_url, sim, worker, tmp_path, jobs=("j1",), n=12):
    """Enqueue into each job and run a burst worker against a small-context sim."""
    server = sim(context_length=SMALL_CONTEXT, **FAST_SIM)
    src = tmp_path / "prompts.jsonl"
    ids, long_ids = write_mixed(src, n)
    out = tmp_path / "out"
    for job in jobs:
        enqueue(redis_url, src, job, out)
    proc = worker(server, "--burst")
    assert proc.wait(timeout=60) == 0, proc.log()
    return server, src, out, ids, long_ids


def total(rconn, job: str) -> int:
    return int(rconn.hget(keys.job_stats(job), "total") or 0)


def done_count(rconn, job: str) -> int:
    workers = [w.decode() for w in rconn.smembers(keys.job_workers(job))]
    return sum(int(rconn.hget(keys.worker_stats(job, w), "done") or 0) for w in workers)


def plain_rq_worker_burst(redis_url: str) -> subprocess.CompletedProcess:
    """A stock `rq worker --burst`: every genq batch fails (worker/intake.py run_batch)."""
    rq_bin = str(Path(sys.executable).parent / "rq")
    return subprocess.run([rq_bin, "worker", "--burst", "-S", "rq.serializers.JSONSerializer", "--url", redis_url,
                           keys.QUEUE], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def fail_batches_in_rq(redis_url: str, rconn, expected: int) -> FailedJobRegistry:
    registry = FailedJobRegistry(queue=rq_queue(rconn))
    for _ in range(3):  # RQ re-queues a retried job at once, so one burst run normally exhausts it
        log = plain_rq_worker_burst(redis_url)
        if registry.count >= expected:
            break
    assert registry.count == expected, log.stdout + log.stderr
    assert "genq batches are run by `genq worker`" in log.stdout + log.stderr
    return registry


def test_overlength_prompts_are_dead_lettered_then_requeued_and_complete_once(redis_url, rconn, sim, worker, tmp_path):
    small, _, out, ids, long_ids = dead_letters_the_real_way(redis_url, sim, worker, tmp_path)
    assert len(long_ids) == 3
    found = audit(rconn, "j1", out, ids)
    assert sorted(found.letters) == long_ids and sorted(found.results) == sorted(set(ids) - set(long_ids))

    letters = dlq_json(redis_url)
    assert sorted(e["id"] for e in letters) == long_ids
    old_batches = {e["batch"] for e in letters}
    for e in letters:
        assert e["job"] == "j1" and e["kind"] == "bad_request" and e["status"] == 400 and e["attempts"] == 1
        match = TOO_LONG.match(e["message"])
        assert match and int(match.group(2)) == SMALL_CONTEXT and int(match.group(1)) > SMALL_CONTEXT, e["message"]
        assert e["worker"] and e["batch"].startswith("b")
        assert abs(datetime.fromisoformat(e["at"].replace("Z", "+00:00")).timestamp() - e["at_epoch"]) < 1
    assert dlq_json(redis_url, "--job", "j1") == letters
    assert len(dlq_json(redis_url, "--limit", "2")) == 2

    table = run_genq("dlq", "list", redis_url=redis_url).stdout
    for pid in long_ids:
        assert re.search(rf"^{pid}\s+j1\s+b\d+\s+1\s+bad_request\s+400\s+The input", table, re.M), table
    assert "3 entries in any job: bad_request 3" in table

    shown = run_genq("dlq", "show", long_ids[0], redis_url=redis_url).stdout
    assert next(e["message"] for e in letters if e["id"] == long_ids[0]) in shown  # in full, not shortened
    assert "x" * 2000 in shown  # the prompt itself
    full = json.loads(run_genq("dlq", "show", long_ids[0], "--json", redis_url=redis_url).stdout)
    assert full["prompt"]["messages"][0]["content"].startswith("x" * 2000)

    # A server with room for them: requeue, then a worker finishes them.
    sim.procs[small].stop()
    big = sim(context_length=32768, **FAST_SIM)
    requeued = run_genq("dlq", "requeue", "--all", redis_url=redis_url).stdout
    match = re.search(r"job j1: requeued 3 prompts as 1 new batch: (b\d+)", requeued)
    assert match, requeued
    assert match.group(1) not in old_batches
    assert dlq_json(redis_url) == [] and rconn.hlen(keys.job_dlq("j1")) == 0
    assert total(rconn, "j1") == 12  # the same prompts: not counted twice
    again = run_genq("dlq", "requeue", "--all", redis_url=redis_url).stdout
    assert "nothing to requeue" in again

    proc = worker(big, "--burst")
    assert proc.wait(timeout=60) == 0, proc.log()
    rows = read_results(out, "j1")
    assert Counter(r["id"] for r in rows) == Counter(ids)  # every prompt exactly once
    for row in rows:
        if row["id"] in long_ids:
            assert row["batch"] == match.group(1) and row["attempts"] == 1  # attempts start over
    assert sum(sim_stats(big)["generated_by_key"].values()) == 3  # only the requeued ones ran again
    assert dlq_json(redis_url) == []
    assert done_count(rconn, "j1") == 12 and rconn.hlen(keys.job_dlq("j1")) == 0
    found = audit(rconn, "j1", out, ids)
    assert not found.letters and found.monitor["batches_total"] == 4  # 3 first batches + the requeued one


def test_letters_of_a_batch_still_held_are_not_requeued_or_purged(redis_url, rconn, sim, worker, tmp_path):
    # Every request that passes the context check hangs: the worker keeps the batch, while
    # the over-long prompt's 400 makes a letter at once.
    server = sim(context_length=SMALL_CONTEXT, hang_rate=1.0, **FAST_SIM)
    src = tmp_path / "prompts.jsonl"
    _, long_ids = write_mixed(src, 4)
    enqueue(redis_url, src, "held", tmp_path / "out")
    worker(server, "--burst", "--grace-period", "0")
    wait_until(lambda: rconn.hlen(keys.job_dlq("held")) == 1, 30, "the over-long prompt's dead letter")

    proc = run_genq("dlq", "requeue", "--all", redis_url=redis_url, check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"skipped {long_ids[0]}: its batch b0000001 has not finished" in proc.stderr
    proc = run_genq("dlq", "purge", "--yes", redis_url=redis_url, check=False)
    assert proc.returncode == 3 and f"kept {long_ids[0]}" in proc.stderr, proc.stdout + proc.stderr
    assert [e["id"] for e in dlq_json(redis_url)] == long_ids
    assert total(rconn, "held") == 4


def test_purge_asks_then_forgets_and_the_rows_can_be_enqueued_again(redis_url, rconn, sim, worker, tmp_path):
    server, src, out, ids, long_ids = dead_letters_the_real_way(redis_url, sim, worker, tmp_path, jobs=("j1", "j2"))
    # The same prompt id is dead in two jobs: naming it needs --job.
    proc = run_genq("dlq", "show", long_ids[0], redis_url=redis_url, check=False)
    assert proc.returncode == 1 and "several jobs (j1, j2): add --job" in proc.stderr, proc.stderr
    assert run_genq("dlq", "show", long_ids[0], "--job", "j2", redis_url=redis_url).stdout.count("job:         j2") == 1

    declined = subprocess.run([sys.executable, "-m", "genq", "--redis", redis_url, "dlq", "purge", "--job", "j1"],
                              input="n\n", capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert declined.returncode == 0 and "Purge 3 dead prompts of job j1?" in declined.stdout, declined.stdout
    assert "nothing purged" in declined.stdout, declined.stdout
    assert len(dlq_json(redis_url, "--job", "j1")) == 3

    purged = run_genq("dlq", "purge", "--job", "j1", "--yes", redis_url=redis_url).stdout
    assert "job j1: purged 3 dead prompts" in purged
    assert dlq_json(redis_url, "--job", "j1") == []
    assert len(dlq_json(redis_url, "--job", "j2")) == 3  # another job's letters are untouched
    # Forgotten: out of the total, so done + failed == total and the job is complete.
    assert total(rconn, "j1") == 9 == done_count(rconn, "j1")
    assert int(rconn.hget(keys.job_stats("j1"), "purged")) == 3
    # ... and out of the id index: enqueueing the same input queues exactly those again.
    again = run_genq("enqueue", str(src), "--job", "j1", redis_url=redis_url).stdout
    assert "queued 3 prompts" in again and "skipped 9 prompts" in again, again

    assert "nothing to purge" in run_genq("dlq", "purge", "--job", "j1", "--yes", redis_url=redis_url).stdout

    # The purged prompts are out of j1's input (re-enqueued above, not yet run); j2 is untouched.
    w = worker(server, "--burst")
    assert w.wait(timeout=60) == 0, w.log()
    assert sorted(audit(rconn, "j1", out, ids).letters) == long_ids  # the same small server rejects them again
    assert sorted(audit(rconn, "j2", out, ids).letters) == long_ids


def record_partial_result(redis_url: str, job: str, batch: str, prompt_id: str) -> None:
    """What a worker that finished one prompt and then died leaves behind (through the engine's writer)."""

    async def go() -> None:
        conn = connect_async(redis_url)
        config = unpack(await conn.get(keys.job_config(job)), JobConfig)  # RECORD writes for this incarnation only
        writer = ResultWriter(conn, "lost-worker", SimpleNamespace(on_written=lambda *_: None))
        task = asyncio.create_task(writer.run())
        writer.add_result(Result(
            id=prompt_id, job=job, batch=batch, index=0, completion="finished before the crash",
            finish_reason="stop", usage=Usage(prompt_tokens=5, completion_tokens=4), model="m",
            worker="lost-worker", attempts=1, latency_s=0.1,
        ), config.incarnation)
        await writer.wait_idle()
        task.cancel()
        await conn.aclose()

    asyncio.run(go())


def test_failed_rq_batch_is_listed_requeued_and_completed(redis_url, rconn, sim, worker, tmp_path):
    src = tmp_path / "prompts.jsonl"
    ids, _ = write_mixed(src, 6, long_every=1000)
    out = tmp_path / "out"
    enqueue(redis_url, src, "fb", out, batch_size=20)
    record_partial_result(redis_url, "fb", "b0000001", ids[0])
    registry = fail_batches_in_rq(redis_url, rconn, expected=1)
    (old_rq_id,) = registry.get_job_ids()
    found = audit(rconn, "fb", out, ids, failed_batches={"b0000001"})
    assert list(found.pending) == [ids[0]] and found.unfinished == set(ids[1:])

    (entry,) = dlq_json(redis_url)
    assert entry["id"] == "batch:b0000001" and entry["kind"] == "batch_failed" and entry["job"] == "fb"
    assert entry["message"].startswith("RuntimeError: batch fb/b0000001: genq batches are run by `genq worker`")
    assert entry["prompts"] == 6 and entry["rq_job"] == old_rq_id and entry["status"] is None
    assert entry["attempts"] == 1  # genq uses no RQ retries: a failed transport is the reconciler's
    assert "batch_failed" in run_genq("dlq", "list", redis_url=redis_url).stdout
    shown = run_genq("dlq", "show", "batch:b0000001", redis_url=redis_url).stdout
    assert "Traceback (most recent call last)" in shown and "in run_batch" in shown and old_rq_id in shown

    # One prompt already finished: purge keeps the batch rather than throw that away.
    proc = run_genq("dlq", "purge", "--yes", redis_url=redis_url, check=False)
    assert proc.returncode == 3 and "kept batch:b0000001: 1 of its prompts finished" in proc.stderr, proc.stderr
    assert registry.count == 1

    requeued = run_genq("dlq", "requeue", "batch:b0000001", "--job", "fb", redis_url=redis_url).stdout
    assert "job fb: requeued failed batch b0000001 (6 prompts) as a new RQ job" in requeued
    assert registry.count == 0 and rq_queue(rconn).count == 1  # what `rq info` shows: queued, not failed
    assert RqJob.exists(old_rq_id, connection=rconn) is False
    assert dlq_json(redis_url) == []

    server = sim(**FAST_SIM)
    proc = worker(server, "--burst")
    assert proc.wait(timeout=60) == 0, proc.log()
    rows = read_results(out, "fb")
    assert Counter(r["id"] for r in rows) == Counter(ids)
    assert sum(sim_stats(server)["generated_by_key"].values()) == 5  # the finished one was not regenerated
    assert registry.count == 0 and rq_queue(rconn).count == 0
    assert audit(rconn, "fb", out, ids).results[ids[0]]["completion"] == "finished before the crash"


def test_failed_rq_batch_purge_forgets_its_prompts(redis_url, rconn, tmp_path):
    src = tmp_path / "prompts.jsonl"
    write_mixed(src, 6, long_every=1000)
    enqueue(redis_url, src, "fp", tmp_path / "out", batch_size=20)
    registry = fail_batches_in_rq(redis_url, rconn, expected=1)
    assert audit(rconn, "fp", tmp_path / "out", [f"p{i:05d}" for i in range(6)],
                 failed_batches={"b0000001"}).unfinished == {f"p{i:05d}" for i in range(6)}
    # Declining is the operator's choice (exit 0); no answer at all (stdin closed) is not a yes (exit 1).
    for answer, code, said in (("n\n", 0, "nothing purged"), ("", 1, "no answer")):
        proc = subprocess.run(genq_cmd("dlq", "purge", redis_url=redis_url), input=answer, capture_output=True,
                              text=True, cwd=ROOT, timeout=60)
        assert proc.returncode == code and said in proc.stdout + proc.stderr, (answer, proc.stdout, proc.stderr)
        assert "Aborted" not in proc.stderr and registry.count == 1, proc.stderr
        assert "Purge 1 failed batch of all jobs?" in proc.stdout, proc.stdout  # not "0 dead prompts and ..."
    purged = run_genq("dlq", "purge", "--yes", redis_url=redis_url).stdout
    assert "job fp: purged failed batch b0000001 (6 unfinished prompts forgotten)" in purged
    assert registry.count == 0 and rq_queue(rconn).count == 0
    assert not rconn.exists(keys.batch("fp", "b0000001"))
    stats = {k.decode(): int(float(v)) for k, v in rconn.hgetall(keys.job_stats("fp")).items()}
    assert stats["total"] == 0 and stats["batches"] == 0 and stats["purged"] == 6
    assert dlq_json(redis_url) == []
    # Forgotten: nothing expected, nothing stored, nothing queued; the purged batch left the ledger too
    # (it used to stay in keys.job_batches: the monitor then said batches 0/1 and 'queued' forever).
    audit(rconn, "fp", tmp_path / "out", [])
    assert rconn.zcard(keys.job_batches("fp")) == 0


def test_unknown_job_or_id_is_a_clear_error(redis_url, tmp_path):
    src = tmp_path / "prompts.jsonl"
    write_mixed(src, 2)
    enqueue(redis_url, src, "real", tmp_path / "out")
    for args in (["list"], ["show", "p00001"], ["requeue", "--all"], ["purge", "--yes"]):
        proc = run_genq("dlq", *args, "--job", "nope", redis_url=redis_url, check=False)
        assert proc.returncode == 1 and "no job named 'nope' (known jobs: real)" in proc.stderr, (args, proc.stderr)
    for args in (["show", "p00099"], ["requeue", "p00099", "p00000"], ["show", "batch:b0000042"]):
        proc = run_genq("dlq", *args, redis_url=redis_url, check=False)
        assert proc.returncode == 1 and "no dead letter or failed batch with id" in proc.stderr, (args, proc.stderr)
    proc = run_genq("dlq", "requeue", redis_url=redis_url, check=False)
    assert proc.returncode == 2 and "give either --all or one or more IDs" in proc.stderr
    assert "the dead-letter queue is empty" in run_genq("dlq", "list", redis_url=redis_url).stdout


def test_requeue_overrides_are_checked_for_the_jobs_endpoint(redis_url, rconn, sim, worker, tmp_path):
    """A chat-only field given to a completions job's dead prompts is refused, as at enqueue (it was
    queued, and the server would have ignored it); the letters stay."""
    server = sim(context_length=SMALL_CONTEXT, **FAST_SIM)
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"id": "long", "prompt": "x" * 2000}) + "\n")
    run_genq("enqueue", str(src), "--job", "comp", "--endpoint", "completions", "--max-tokens", "16",
             "--output", str(tmp_path / "out"), redis_url=redis_url)
    assert worker(server, "--burst").wait(timeout=60) == 0
    assert [e["id"] for e in dlq_json(redis_url)] == ["long"]
    proc = run_genq("dlq", "requeue", "--all", "--extra-body", '{"chat_template_kwargs": {"enable_thinking": true}}',
                    redis_url=redis_url, check=False)
    assert proc.returncode == 2 and "--extra-body: 'chat_template_kwargs' is a chat field" in proc.stderr, \
        proc.stdout + proc.stderr
    assert [e["id"] for e in dlq_json(redis_url)] == ["long"]


def test_requeue_options_are_checked_whatever_the_queue_holds(redis_url, tmp_path):
    """A bad override is bad usage even with nothing to requeue (it said "nothing to requeue", exit 0);
    a field with its own option names requeue's option, not `genq jobs set`."""
    src = tmp_path / "prompts.jsonl"
    write_mixed(src, 2)
    enqueue(redis_url, src, "chat", tmp_path / "out")
    for body, message in (('{"echo": true}', "--extra-body: 'echo' is a /v1/completions field"),
                          ('{"temperature": 0.5}', "'temperature' cannot be set here; give --temperature"),
                          ('{"top_p": 0.5}', "'top_p' cannot be set here; give --top-p")):
        proc = run_genq("dlq", "requeue", "--all", "--job", "chat", "--extra-body", body, redis_url=redis_url,
                        check=False)
        assert proc.returncode == 2 and message in proc.stderr, proc.stdout + proc.stderr
        assert "jobs set" not in proc.stderr, proc.stderr


def test_list_shows_a_message_with_brackets_as_it_is(redis_url, rconn, tmp_path):
    """A server's message is text, not rich markup: "[/messages/0]" crashed `genq dlq list`."""
    import time

    from genq.core.records import DeadLetter, pack

    message = "value at [/messages/0] is [bold]x"
    rconn.hset(keys.job_dlq("brk"), "p1", pack(DeadLetter(id="p1", job="brk", batch="b0000001", attempts=1,
                                                          kind="bad_request", message=message, worker="w",
                                                          at=time.time(), status=400)))
    rconn.sadd(keys.JOBS, "brk")
    shown = run_genq("dlq", "list", check=False)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    assert message in shown.stdout, shown.stdout


def test_a_requeue_written_then_redis_flushed_recovers_without_the_letters_back(
        redis_url, rconn, sim, worker, tmp_path):
    """Letters requeued, their new batch written, then FLUSHALL: recover counts every prompt once (the old
    batch's marker names them as letters, the requeued batch's as results), the DLQ empty, nothing again."""
    small, _, out, ids, long_ids = dead_letters_the_real_way(redis_url, sim, worker, tmp_path)
    sim.procs[small].stop()
    big = sim(context_length=32768, **FAST_SIM)
    run_genq("dlq", "requeue", "--all", "--max-tokens", "12", redis_url=redis_url)
    assert worker(big, "--burst").wait(timeout=60) == 0
    rconn.flushall()
    run_genq("recover", "--job", "j1", "--output", str(out), redis_url=redis_url)
    assert dlq_json(redis_url) == []
    assert worker(big, "--burst").wait(timeout=60) == 0
    assert sum(sim_stats(big)["generated_by_key"].values()) == 3  # nothing generated again
    found = audit(rconn, "j1", out, ids)
    assert not found.letters and sorted(found.results) == sorted(ids)


def test_a_requeue_redis_lost_is_requeued_again_with_its_override(redis_url, rconn, sim, worker, tmp_path):
    """Letters requeued with --max-tokens, then FLUSHALL before any worker ran them: recover brings the letters
    back from the markers, and the requeue record sends them again with the override they were requeued with."""
    small, _, out, ids, long_ids = dead_letters_the_real_way(redis_url, sim, worker, tmp_path)
    sim.procs[small].stop()
    big = sim(context_length=32768, **{**FAST_SIM, "mean_output_tokens": 200})
    run_genq("dlq", "requeue", "--all", "--max-tokens", "3", redis_url=redis_url)
    rconn.flushall()
    run_genq("recover", "--job", "j1", "--output", str(out), redis_url=redis_url)
    assert worker(big, "--burst").wait(timeout=60) == 0
    rows = {r["id"]: r for r in read_results(out, "j1")}
    assert sorted(rows) == sorted(ids), "every prompt has a result"
    assert all(rows[i]["usage"]["completion_tokens"] <= 3 for i in long_ids), \
        {i: rows[i]["usage"]["completion_tokens"] for i in long_ids}
    audit(rconn, "j1", out, ids)
