"""The engine's side of a lease (worker/batches.py drives it): what Redis recorded of a taken batch,
the lease check after each beat, and the hand-back (genq.core.ledger defines the terms)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import redis
import redis.asyncio as aioredis
from redis.client import Pipeline
from redis.exceptions import WatchError

from genq.core import keys
from genq.core.ledger import forget_rq_job, lease_token
from genq.core.queueing import enqueue_batch_jobs
from genq.core.records import BatchRef, JobConfig, pack, unpack
from genq.core.scripts import RQ_EXECUTION


async def config_now(conn: aioredis.Redis, job: str) -> JobConfig | None:
    """A job's settings as they are now (read for every delivery, never kept by name)."""
    raw = await conn.get(keys.job_config(job))
    return unpack(raw, JobConfig) if raw is not None else None


async def batch_record(conn: aioredis.Redis, ref: BatchRef) -> bytes | None:
    """The batch's stored record (genq.core.batches decodes it); None once released or deleted."""
    return await conn.get(keys.batch(ref.job, ref.batch))


async def finished_ids(conn: aioredis.Redis, ref: BatchRef, ids: list[str]) -> set[str]:
    """outcome_ids read in one transaction (what a batch just taken has left to send)."""
    return await outcome_ids(conn, ref, ids, transaction=True)


async def outcome_ids(conn: aioredis.Redis, ref: BatchRef, ids: list[str], *, transaction: bool = False) -> set[str]:
    """Of these prompt ids of the batch, those with an outcome recorded (a result or a dead letter)."""
    async with conn.pipeline(transaction=transaction) as pipe:
        pipe.hmget(keys.batch_results(ref.job, ref.batch), ids)
        pipe.hmget(keys.job_dlq(ref.job), ids)
        results, letters = await pipe.execute()
    return {i for i, r, d in zip(ids, results, letters) if r is not None or d is not None}


async def claim_owners(conn: aioredis.Redis, ref: BatchRef, ids: list[str]) -> list[bytes | None]:
    """Who claimed each of these prompts of the batch, as CLAIM wrote it (None: unclaimed)."""
    return await conn.hmget(keys.batch_claims(ref.job, ref.batch), ids)


async def stored_outcomes(conn: aioredis.Redis, ref: BatchRef, ids: list[str]
                          ) -> tuple[bool, bytes | None, bytes | int | None, list[bytes], list[bytes | None] | None]:
    """What the batch's shard is built from, in one transaction: whether it is done, its job's settings,
    the batch record (given `ids`: only whether it is still there), its stored results, and the letters
    of `ids` (None without ids: letters_of, once the record names them); all packed."""
    async with conn.pipeline(transaction=True) as pipe:
        pipe.sismember(keys.job_done(ref.job), ref.batch)
        pipe.get(keys.job_config(ref.job))
        if ids:
            pipe.exists(keys.batch(ref.job, ref.batch))
        else:
            pipe.get(keys.batch(ref.job, ref.batch))
        pipe.hvals(keys.batch_results(ref.job, ref.batch))
        if ids:
            pipe.hmget(keys.job_dlq(ref.job), ids)
        done, raw_config, raw_batch, raw_results, *raw_letters = await pipe.execute()
    return bool(done), raw_config, raw_batch, raw_results, raw_letters[0] if raw_letters else None


async def letters_of(conn: aioredis.Redis, job: str, ids: list[str]) -> list[bytes | None]:
    """The dead letters of these prompt ids, packed (None: no letter), in order."""
    return await conn.hmget(keys.job_dlq(job), ids)


async def lease_states(conn: aioredis.Redis, refs: list[BatchRef]) -> list[tuple[str | None, bool, str | None]]:
    """For each batch: its job's incarnation now (None: deleted), whether it is done, and the token
    of its current lease; one round trip."""
    jobs = sorted({r.job for r in refs})
    async with conn.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.get(keys.job_config(job))
        for ref in refs:
            pipe.sismember(keys.job_done(ref.job), ref.batch)
            pipe.hget(keys.job_leases(ref.job), ref.batch)
        answers = await pipe.execute()
    incarnations = {job: unpack(raw, JobConfig).incarnation if raw else None
                    for job, raw in zip(jobs, answers[: len(jobs)])}
    answers = answers[len(jobs):]
    return [(incarnations[ref.job], bool(answers[2 * i]), lease_token(answers[2 * i + 1]))
            for i, ref in enumerate(refs)]


def end_lease_if_ours(conn: redis.Redis, ref: BatchRef, token: str,
                      along: Callable[[Pipeline], object]) -> bool:
    """End the lease `token` of the batch, with `along`'s writes in the same transaction, and its RQ
    job leaves RQ. False, writing nothing, if the batch is done or that lease is no longer current."""
    def attempt(pipe: Pipeline) -> bool:
        lease = pipe.hget(keys.job_leases(ref.job), ref.batch)
        if lease_token(lease) != token or pipe.sismember(keys.job_done(ref.job), ref.batch):
            return False
        rq_id = pipe.hget(keys.job_transport(ref.job), ref.batch)
        pipe.multi()
        if rq_id is not None:
            forget_rq_job(pipe, rq_id.decode(), [f"{rq_id.decode()}:{RQ_EXECUTION}".encode()])
        along(pipe)
        pipe.hdel(keys.job_leases(ref.job), ref.batch)
        return True

    return bool(conn.transaction(attempt, keys.job_leases(ref.job), keys.job_done(ref.job),
                                 value_from_callable=True))


def hand_back(conn: redis.Redis, ref: BatchRef, token: str) -> bool:
    """Queue the batch again at the front of the queue as its lease `token` ends (end_lease_if_ours)."""
    return end_lease_if_ours(
        conn, ref, token, lambda pipe: enqueue_batch_jobs(pipe, conn, [(ref.job, ref.batch, 0)], at_front=True))


async def pin_model(conn: aioredis.Redis, job: str, model: str, auto: str) -> tuple[JobConfig | None, bool]:
    """The job's settings with the model `auto` replaced by `model` in the stored config unless another
    engine resolved it first, and whether this call pinned it; (None, False) if the job is gone."""
    key = keys.job_config(job)
    async with conn.pipeline(transaction=True) as pipe:
        while True:
            try:
                await pipe.watch(key)
                raw = await pipe.get(key)
                if raw is None:
                    return None, False
                config = unpack(raw, JobConfig)
                if config.model != auto:
                    return config, False
                pinned = msgspec.structs.replace(config, model=model)
                pipe.multi()
                pipe.set(key, pack(pinned))
                await pipe.execute()
                return pinned, True
            except WatchError:
                continue
