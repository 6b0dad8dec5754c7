"""Batches in Redis and their RQ jobs: the only code that creates either. An RQ job holds only (job,
batch id), as JSON (never pickle), and is recorded in keys.job_transport in the transaction that queues
it; RQ's retries are not used: the reconciler puts back a batch whose RQ job failed or vanished."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import redis
from redis.client import Pipeline
from rq import Queue, Worker, suspension
from rq.exceptions import InvalidJobOperation
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.results import Result as RqResult
from rq.serializers import JSONSerializer

from genq.core import keys, scripts
from genq.core.records import BatchSource, JobConfig, Prompt, batch_id, batch_number, pack, unpack

# LOOKUP_IDS's answer per id against keys.job_ids: new, queued with the same content, with other content.
ID_NEW, ID_SAME, ID_OTHER = "0", "1", "2"

RUN_BATCH = "genq.worker.intake.run_batch"  # what a stock RQ worker would run: it refuses (worker/intake.py)
OLD_RUN_BATCH = "genq.worker.rqjob.run_batch"  # RQ jobs queued by genq before the engine took batches itself
DESCRIPTION = "genq batch "  # + "JOB/BATCH (N prompts)": what `rq info` shows, and what the monitor reads


def carried(rq_job: Job | None) -> tuple[str, str] | None:
    """(job, batch id) of a genq batch's RQ job; None for anything else (another app's, or not JSON)."""
    try:
        if rq_job is None or rq_job.func_name not in (RUN_BATCH, OLD_RUN_BATCH) or len(rq_job.args) < 2:
            return None
        return str(rq_job.args[0]), str(rq_job.args[1])
    except Exception:  # not JSON: not ours to read
        return None


def batch_of_description(description: bytes | str | None) -> tuple[str, str] | None:
    """(job, batch) from an RQ job's description (one HGET, not the whole job); None if not genq's."""
    text = description.decode(errors="replace") if isinstance(description, bytes) else description or ""
    if not text.startswith(DESCRIPTION):
        return None
    job, _, batch = text[len(DESCRIPTION):].split(" ", 1)[0].partition("/")
    return (job, batch) if job and batch else None


def rq_queue(conn: redis.Redis) -> Queue:
    return Queue(keys.QUEUE, connection=conn, serializer=JSONSerializer)


def fetch_rq_jobs(conn: redis.Redis, ids: Sequence[str]) -> list[Job | None]:
    return Job.fetch_many(list(ids), connection=conn, serializer=JSONSerializer)


def fetch_rq_job(conn: redis.Redis | Pipeline, rq_id: str) -> Job:
    """One RQ job (on a pipeline under WATCH: read at once); raises rq's NoSuchJobError if gone."""
    return Job.fetch(rq_id, connection=conn, serializer=JSONSerializer)


def rq_worker(conn: redis.Redis, name: str) -> Worker:
    """An engine as `rq info` lists it: registered and heartbeaten by the engine (worker/intake.py), never run."""
    return Worker([rq_queue(conn)], name=name, connection=conn, serializer=JSONSerializer)


def failed_registry(conn: redis.Redis) -> FailedJobRegistry:
    return FailedJobRegistry(queue=rq_queue(conn))


def delete_rq_job(pipe: Pipeline, rq_job: Job, *, remove_from_queue: bool = True) -> None:
    """Delete an RQ job and its stored results in `pipe` (RQ's delete leaves its results behind)."""
    try:
        rq_job.delete(pipeline=pipe, remove_from_queue=remove_from_queue)
    except InvalidJobOperation:
        pipe.delete(rq_job.key)
    pipe.delete(RqResult.get_key(rq_job.id))


def suspend_loops(conn: redis.Redis, suspended: bool = True) -> None:
    """As `rq suspend` (`rq resume`, suspended=False): no engine takes a new batch."""
    (suspension.suspend if suspended else suspension.resume)(conn)


def load_config(conn: redis.Redis, job: str) -> JobConfig | None:
    raw = conn.get(keys.job_config(job))
    return unpack(raw, JobConfig) if raw else None


def save_config(pipe: redis.Redis | Pipeline, config: JobConfig) -> None:
    """Store a job's config (on a pipeline: enqueue's, in the transaction of its first batches)."""
    pipe.set(keys.job_config(config.name), pack(config))
    pipe.sadd(keys.JOBS, config.name)
    pipe.hsetnx(keys.job_stats(config.name), "created_at", repr(config.created_at or time.time()))


def list_jobs(conn: redis.Redis) -> list[str]:
    return sorted(name.decode() for name in conn.smembers(keys.JOBS))


def load_batch(conn: redis.Redis, job: str, batch_id: str) -> BatchSource | None:
    """The batch's record (its ids: prompt_ids(); its prompts: genq.producer.sources)."""
    raw = conn.get(keys.batch(job, batch_id))
    return unpack(raw, BatchSource) if raw else None


def write_batches(pipe: Pipeline, conn: redis.Redis, batches: Sequence[BatchSource], digests: dict[str, bytes], *,
                  count_total: bool = True) -> None:
    """Queue new batches in `pipe` (MULTI): records, RQ jobs, and their ids' content digests and batches in
    keys.job_ids, so no id is marked queued without a job that will run it."""
    for batch in batches:
        pipe.set(keys.batch(batch.job, batch.id), pack(batch))
        pipe.zadd(keys.job_batches(batch.job), {batch.id: batch_number(batch.id)})
        if count_total:
            pipe.hincrby(keys.job_stats(batch.job), "total", batch.count)
        pipe.hincrby(keys.job_stats(batch.job), "batches", 1)
    if digests and batches:
        placed = [(i, b.id) for b in batches for i in b.prompt_ids() if i in digests]
        call = scripts.ids_call(batches[0].job, [(i, digests[i]) for i, _ in placed], [b for _, b in placed])
        scripts.evaluate(pipe, scripts.CLAIM_IDS, call)
    enqueue_batch_jobs(pipe, conn, [(b.job, b.id, b.count) for b in batches])


def lookup_ids(conn: redis.Redis | Pipeline, job: str, digests: Iterable[tuple[str, bytes]]) -> str:
    """One of ID_NEW, ID_SAME, ID_OTHER per (id, 8-byte content digest), in order."""
    answer = scripts.evaluate(conn, scripts.LOOKUP_IDS, scripts.ids_call(job, digests))
    return answer.decode() if isinstance(answer, bytes) else str(answer)


def enqueue_batch_jobs(pipe: Pipeline, conn: redis.Redis, refs: Iterable[tuple[str, str, int]], *,
                       at_front: bool = False) -> list[str]:
    """One RQ job per (job, batch id, prompt count), queued in `pipe` and recorded as the batch's
    transport; the RQ job ids. No timeout: a batch's tail can take hours; liveness is the heartbeat's."""
    queue = rq_queue(conn)
    refs = list(refs)
    datas = [Queue.prepare_data(RUN_BATCH, args=(job, batch_id), timeout=-1, result_ttl=3600, failure_ttl=24 * 3600,
                                description=f"{DESCRIPTION}{job}/{batch_id} ({size} prompts)", at_front=at_front)
             for job, batch_id, size in refs]
    if not datas:
        return []
    rq_jobs = queue.enqueue_many(datas, pipeline=pipe)
    for (job, bid, _), rq_job in zip(refs, rq_jobs):
        pipe.hset(keys.job_transport(job), bid, rq_job.id)
    pipe.publish(keys.WAKE, keys.WAKE_QUEUED)  # idle engines take them now (worker/intake.py)
    return [j.id for j in rq_jobs]


def new_batches(conn: redis.Redis, job: str, prompts: Sequence[Prompt], batch_size: int,
                floor: int = 0) -> list[BatchSource]:
    """Split prompts into inline batches (not yet written) numbered above the job's counter and above `floor`, the
    numbers its output folder may hold: a Redis restored from an older state must not hand out a written one."""
    chunks = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    if not chunks:
        return []
    seq = keys.job_batch_seq(job)

    def allocate(pipe: Pipeline) -> int:
        last = max(int(pipe.get(seq) or 0), floor) + len(chunks)
        pipe.multi()
        pipe.set(seq, last)
        return last

    last = int(conn.transaction(allocate, seq, value_from_callable=True))
    created = time.time()
    return [BatchSource.inline(job, batch_id(last - len(chunks) + n), chunk, created)
            for n, chunk in enumerate(chunks, 1)]
