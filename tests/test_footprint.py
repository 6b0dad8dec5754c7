"""Issue #15: what a job keeps in Redis, and a monitor refresh that does not grow with the job.

- A result is stored without its copy of the prompt; the shard still carries it (joined from
  the batch's prompts when the shard is assembled).
- The shards' records and bytes are running totals kept by the ledger's RELEASE; a job whose
  shards an older genq wrote is counted once and gets them.
- The monitor's mirror of RQ's queue reads only the queue's ends between refreshes and always
  counts what a full read counts.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import redis

from genq.core import keys, scripts
from genq.core.ledger.figures import read_job
from genq.core.queueing import enqueue_batch_jobs, rq_queue, save_config
from genq.core.records import BatchRef, JobConfig, Result, ShardInfo, Usage, pack, unpack
from genq.core.redisconn import connect_async
from genq.monitor.rqqueue import QueueMirror
from genq.worker.results import ResultWriter
from tests.audit import audit
from tests.conftest import read_results, run_genq, write_prompts


def _commit(redis_url: str, result: Result) -> None:
    """Commit one result through the engine's result writer (what a worker does, then dies)."""

    async def go() -> None:
        conn = connect_async(redis_url)
        config = await conn.get(keys.job_config(result.job))
        writer = ResultWriter(conn, "lost-worker", SimpleNamespace(on_written=lambda *_: None))
        task = asyncio.create_task(writer.run())
        writer.add_result(result, unpack(config, JobConfig).incarnation)
        await writer.wait_idle()
        task.cancel()
        await conn.aclose()

    asyncio.run(go())


def test_stored_results_carry_no_prompt_and_shards_do(redis_url, rconn, sim, worker, tmp_path):
    src, out = tmp_path / "p.jsonl", tmp_path / "out"
    ids = write_prompts(src, 30, extra={"source": "wiki"})
    run_genq("enqueue", str(src), "--job", "fp", "--batch-size", "10", "--output", str(out),
             "--max-tokens", "16", redis_url=redis_url)
    messages = [{"role": "user", "content": "prompt number 0"}]
    _commit(redis_url, Result(
        id=ids[0], job="fp", batch="b0000001", index=0, completion="finished before the crash",
        finish_reason="stop", usage=Usage(prompt_tokens=5, completion_tokens=4), model="m", worker="lost-worker",
        attempts=1, latency_s=0.1, messages=messages, metadata={"source": "wiki"}, custom_id="c0"))
    raw = rconn.hget(keys.batch_results("fp", "b0000001"), ids[0])
    stored = unpack(raw, Result)
    assert stored.completion == "finished before the crash"
    assert (stored.messages, stored.prompt, stored.metadata, stored.custom_id) == (None, None, {}, None), \
        "the result in Redis carries a second copy of its prompt"

    w = worker(sim(), "--burst")
    assert w.wait(120) == 0, w.log()
    audit(rconn, "fp", out, ids)
    rows = {r["id"]: r for r in read_results(out, "fp")}
    assert rows[ids[0]]["completion"] == "finished before the crash"
    for i, pid in enumerate(ids):
        assert rows[pid]["messages"] == [{"role": "user", "content": f"prompt number {i}"}], rows[pid]
        assert rows[pid]["metadata"] == {"source": "wiki"}, rows[pid]


def test_shard_totals_are_counted_once_for_a_job_of_an_older_genq(rconn):
    # Shards recorded the old way (no totals in the job's stats), as an older genq left them.
    infos = [ShardInfo(batch=f"b{i:07d}", uri=f"/o/j/shards/b{i:07d}.jsonl", records=10 + i, bytes=1000 * i,
                       at=1.0) for i in range(1, 6)]
    rconn.hset(keys.job_stats("old"), mapping={"total": 100, "batches": 10})
    rconn.sadd(keys.JOBS, "old")
    for info in infos:
        rconn.hset(keys.job_shards("old"), info.batch, pack(info))
        rconn.sadd(keys.job_done("old"), info.batch)
    snap = read_job(rconn, "old")
    assert snap is not None
    assert (snap.shards, snap.shard_records, snap.shard_bytes) == (5, sum(i.records for i in infos),
                                                                   sum(i.bytes for i in infos))
    stats = rconn.hgetall(keys.job_stats("old"))
    assert int(stats[scripts.SHARD_RECORDS.encode()]) == snap.shard_records  # kept: counted once
    # A new genq's RELEASE then adds to them, and never counts them again (a config of a genq
    # before incarnations, and the shard's 7 results: RELEASE checks both).
    release = rconn.register_script(scripts.RELEASE)
    info = ShardInfo(batch="b0000006", uri="/o/j/shards/b0000006.jsonl", records=7, bytes=70, at=2.0)
    save_config(rconn, JobConfig(name="old", output="/o"))
    stored = {f"p{i}": b"result" for i in range(7)}
    rconn.hset(keys.batch_results("old", info.batch), mapping=stored)
    script_keys, args = scripts.release_call(BatchRef("old", info.batch), info, "", stored, [])
    release(keys=script_keys, args=args)
    snap = read_job(rconn, "old")
    assert snap is not None and (snap.shards, snap.shard_records, snap.shard_bytes) == (
        6, sum(i.records for i in infos) + 7, sum(i.bytes for i in infos) + 70)


def _full_counts(conn: redis.Redis) -> dict[str, int]:
    fresh = QueueMirror()
    fresh.refresh(conn)
    assert fresh.full_reads == 1 or fresh.total == 0
    return dict(fresh.by_job)


def test_queue_mirror_counts_what_a_full_read_counts(rconn):
    rng = random.Random(15)
    queue = rq_queue(rconn)
    mirror = QueueMirror()
    seq = 0

    def push(job: str, n: int, front: bool = False) -> None:
        nonlocal seq
        with rconn.pipeline(transaction=True) as pipe:
            enqueue_batch_jobs(pipe, rconn, [(job, f"b{seq + i:07d}", 4) for i in range(n)], at_front=front)
            pipe.execute()
        seq += n

    push("a", 300)
    push("b", 200)
    mirror.refresh(rconn)
    assert dict(mirror.by_job) == {"a": 300, "b": 200} and mirror.total == 500
    full_before = mirror.full_reads
    for step in range(60):
        op = rng.choice(["push", "front", "pop", "pop", "nothing"])
        if op == "push":
            push(rng.choice("ab"), rng.randint(1, 90))
        elif op == "front":
            push(rng.choice("ab"), rng.randint(1, 3), front=True)
        elif op == "pop":
            for _ in range(rng.randint(1, 40)):
                rconn.lmove(queue.key, "genq:test:taken", "LEFT", "RIGHT")
        mirror.refresh(rconn)
        assert dict(mirror.by_job) == _full_counts(rconn), f"step {step} ({op})"
        assert mirror.total == rconn.llen(queue.key)
    assert mirror.full_reads == full_before, "changes at the ends alone made the mirror read the whole queue"
    # A removal in the middle (genq jobs delete, RQ's remove) is noticed: the counts stay exact.
    ids = rconn.lrange(queue.key, 0, -1)
    rconn.lrem(queue.key, 0, ids[len(ids) // 2])
    push("b", 1)
    mirror.refresh(rconn)
    assert dict(mirror.by_job) == _full_counts(rconn)
    assert mirror.full_reads == full_before + 1
    # Anything at all (removals anywhere, the queue emptied and refilled): always a full read's counts.
    for step in range(60):
        op = rng.choice(["push", "front", "pop", "lrem", "drain"])
        ids = rconn.lrange(queue.key, 0, -1)
        if op == "push":
            push(rng.choice("ab"), rng.randint(1, 200))
        elif op == "front":
            push(rng.choice("ab"), rng.randint(1, 100), front=True)
        elif op == "pop" and ids:
            rconn.lpop(queue.key, rng.randint(1, len(ids)))
        elif op == "lrem" and ids:
            for rq_id in rng.sample(ids, min(len(ids), rng.randint(1, 3))):
                rconn.lrem(queue.key, 0, rq_id)
            push(rng.choice("ab"), rng.randint(0, 2))
        elif op == "drain":
            rconn.delete(queue.key)
            push(rng.choice("ab"), rng.randint(0, 5))
        mirror.refresh(rconn)
        assert dict(mirror.by_job) == _full_counts(rconn), f"step {step} ({op})"
        assert mirror.total == rconn.llen(queue.key)
    rconn.delete(queue.key)
    mirror.refresh(rconn)
    assert mirror.total == 0 and not mirror.by_job
