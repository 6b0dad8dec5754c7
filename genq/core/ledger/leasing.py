"""A batch's lease, the engine's side (worker/batches.py): what Redis recorded of a taken batch, the
lease check after each beat, and the lease's end: queued again, or parked (no RQ job carries a paused
or blocked job's batch until `genq resume --job`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
from redis.client import Pipeline
from rq.results import Result as RqResult

from genq.core import keys
from genq.core.ledger import forget_rq_job, lease_holder, lease_token
from genq.core.ledger import jobs as ledger_jobs
from genq.core.queueing import carried, enqueue_batch_jobs, fetch_rq_jobs, rq_queue
from genq.core.records import BatchRef, JobConfig, JobSchedule, unpack
from genq.core.scripts import RQ_EXECUTION


async def batch_record(conn: aioredis.Redis, ref: BatchRef) -> bytes | None:
    return await conn.get(keys.batch(ref.job, ref.batch))


async def outcome_ids(conn: aioredis.Redis, ref: BatchRef, ids: list[str], *, transaction: bool = False) -> set[str]:
    """Of these prompt ids of the batch, those with a result or a dead letter."""
    async with conn.pipeline(transaction=transaction) as pipe:
        pipe.hmget(keys.batch_results(ref.job, ref.batch), ids)
        pipe.hmget(keys.job_dlq(ref.job), ids)
        results, letters = await pipe.execute()
    return {i for i, r, d in zip(ids, results, letters) if r is not None or d is not None}


async def claim_owners(conn: aioredis.Redis, ref: BatchRef, ids: list[str]) -> list[bytes | None]:
    return await conn.hmget(keys.batch_claims(ref.job, ref.batch), ids)


@dataclass
class Stored:
    """What a batch's shard is built from, read in one transaction (stored_outcomes); packed."""

    done: bool
    config: bytes | None  # its job's
    record: int  # whether the batch record exists
    results: list[bytes]
    letters: list[bytes | None]  # of the ids asked
    lease: str | None  # the current lease's token


async def stored_outcomes(conn: aioredis.Redis, ref: BatchRef, ids: list[str]) -> Stored:
    async with conn.pipeline(transaction=True) as pipe:
        pipe.sismember(keys.job_done(ref.job), ref.batch)
        pipe.get(keys.job_config(ref.job))
        pipe.exists(keys.batch(ref.job, ref.batch))
        pipe.hvals(keys.batch_results(ref.job, ref.batch))
        pipe.hget(keys.job_leases(ref.job), ref.batch)
        pipe.hmget(keys.job_dlq(ref.job), ids)
        done, raw_config, record, raw_results, lease, letters = await pipe.execute()
    return Stored(bool(done), raw_config, record, raw_results, letters, lease_token(lease))


async def lease_states(conn: aioredis.Redis, refs: list[BatchRef]) -> list[tuple[str | None, bool, str | None]]:
    """Per batch: its job's incarnation (None: deleted), whether it is done, its lease's token."""
    jobs = sorted({r.job for r in refs})
    async with conn.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.get(keys.job_config(job))
        for ref in refs:
            pipe.sismember(keys.job_done(ref.job), ref.batch)
            pipe.hget(keys.job_leases(ref.job), ref.batch)
        answers = await pipe.execute()
    incarnations = {job: unpack(raw, JobConfig).incarnation if raw else None for job, raw in zip(jobs, answers)}
    states = answers[len(jobs):]
    return [(incarnations[ref.job], bool(done), lease_token(lease))
            for ref, done, lease in zip(refs, states[::2], states[1::2])]


async def leases_of(conn: aioredis.Redis, instance: str) -> list[tuple[BatchRef, str]]:
    """Every (batch, token) Redis says is leased to this engine instance."""
    jobs = await ledger_jobs.job_names(conn)
    async with conn.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.hgetall(keys.job_leases(job))
        found = await pipe.execute()
    return [(BatchRef(job, b.decode()), str(lease_token(v))) for job, leases in zip(jobs, found)
            for b, v in leases.items() if lease_holder(v) == instance]


def end_lease(conn: redis.Redis, ref: BatchRef, token: str, *, requeue: bool) -> str | None:
    """End the batch's lease `token`, its RQ job out of RQ, and queue it again at the front (`requeue`)
    or park it, in one transaction: "queued" or "parked"; None, writing nothing, if it is done or the
    lease is not current."""
    def attempt(pipe: Pipeline) -> str | None:
        lease = pipe.hget(keys.job_leases(ref.job), ref.batch)
        if lease_token(lease) != token or pipe.sismember(keys.job_done(ref.job), ref.batch):
            return None
        rq_id = pipe.hget(keys.job_transport(ref.job), ref.batch)
        # A park asked for while the job was paused or blocked, ending after `genq resume --job` (the
        # engine waited for its requests in flight): queued, as that resume queued the parked ones.
        queue = requeue or not pipe.exists(keys.job_paused(ref.job), keys.job_blocked(ref.job))
        pipe.multi()
        if rq_id is not None:
            forget_rq_job(pipe, rq_id.decode(), [f"{rq_id.decode()}:{RQ_EXECUTION}".encode()])
        if queue:
            enqueue_batch_jobs(pipe, conn, [(ref.job, ref.batch, 0)], at_front=True)
        else:
            pipe.hdel(keys.job_transport(ref.job), ref.batch)
        pipe.hdel(keys.job_leases(ref.job), ref.batch)
        return "queued" if queue else "parked"

    return conn.transaction(attempt, keys.job_leases(ref.job), keys.job_done(ref.job), keys.job_paused(ref.job),
                            keys.job_blocked(ref.job), value_from_callable=True)


def unqueue(conn: redis.Redis, job: str) -> int:
    """Park the job's queued batches (out of RQ's queue, not taken one by one only to be parked); how many."""
    queue = rq_queue(conn)
    found = [(j, c[1]) for j in fetch_rq_jobs(conn, queue.get_job_ids())
             if j is not None and (c := carried(j)) and c[0] == job]
    if not found:
        return 0
    with conn.pipeline(transaction=False) as pipe:
        for rq_job, _ in found:
            pipe.lrem(queue.key, 0, rq_job.id)
        removed = pipe.execute()
    # Only what left the queue here: a loop that took one meanwhile delivers it, and its engine parks it.
    gone = [(rq_job, batch) for (rq_job, batch), n in zip(found, removed) if n]
    carriers = conn.hmget(keys.job_transport(job), [batch for _, batch in gone]) if gone else []
    with conn.pipeline(transaction=True) as pipe:
        for (rq_job, batch), carrier in zip(gone, carriers):
            if carrier is not None and carrier.decode() == rq_job.id:
                pipe.hdel(keys.job_transport(job), batch)
            # In no registry of RQ's now: its keys go (RQ's delete costs seven round trips).
            pipe.delete(rq_job.key, rq_job.dependents_key, rq_job.dependencies_key, RqResult.get_key(rq_job.id))
        pipe.execute()
    return len(gone)


def resume_job(conn: redis.Redis, job: str,
               change: Callable[[JobSchedule], JobSchedule]) -> tuple[int, JobSchedule]:
    """Lift the job's block and pause, store change(its schedule) and queue every batch of it not done that no
    RQ job carries (parked), in one transaction: a Redis refusing writes takes none of it (a full one refuses
    every command inside MULTI), no worker takes such a batch while the job still reads paused, to park it
    again, and the resume is in Redis in its version's order (ledger_jobs.change_schedule); nothing if `change`
    keeps the schedule. How many were queued (under WATCH, none twice) and the schedule."""
    transport, at = keys.job_transport(job), keys.job_schedule(job)

    def queue(pipe: Pipeline) -> tuple[int, JobSchedule]:
        if (schedule := change(old := ledger_jobs.schedule_of(pipe.get(at)))) is old:
            pipe.multi()  # a newer change is in Redis already: it stands
            return 0, old
        batches = [b.decode() for b in pipe.zrange(keys.job_batches(job), 0, -1)]
        done = {b.decode() for b in pipe.smembers(keys.job_done(job))}
        pending = [b for b in batches if b not in done]
        carried = pipe.hmget(transport, pending) if pending else []
        parked = [b for b, t in zip(pending, carried) if t is None and pipe.exists(keys.batch(job, b))]
        pipe.multi()
        ledger_jobs.resume(pipe, job)
        ledger_jobs.stage_schedule(pipe, job, schedule)
        if parked:
            enqueue_batch_jobs(pipe, conn, [(job, b, 0) for b in parked], at_front=True)
        return len(parked), schedule

    return conn.transaction(queue, transport, keys.job_done(job), at, value_from_callable=True)
