"""A job's own records in Redis: its settings, block, pause and schedule, its counts, its batch
numbering, and every key it has (`genq jobs delete`, `genq recover`)."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import redis
import redis.asyncio as aioredis
from redis.client import Pipeline

from genq.core import keys, scripts
from genq.core.keys import check_job_name as check_job_name  # a job name becomes part of its keys
from genq.core.ledger import lease_holder
from genq.core.records import InFlight, JobBlock, JobConfig, JobSchedule, pack, unpack

R = TypeVar("R")
T = TypeVar("T")


@dataclass
class JobNow:
    config: JobConfig | None  # None: deleted, or written by an incompatible genq
    blocked: JobBlock | None
    paused: bool  # this job (not counting the fleet-wide pause)
    schedule: JobSchedule
    leases: dict[str, str | None] = field(default_factory=dict)  # batch -> holder (an engine); asked for only


def jobs_now(conn: redis.Redis | aioredis.Redis, jobs: Iterable[str], *, leases: bool = False,
             together: bool = False) -> Any:
    """Each job's JobNow, in order, in one round trip; on an asyncio client, an awaitable of it. `together`: in
    MULTI, a pause and its schedule's version read as one (genq.ops.control.pause), which a full Redis refuses."""
    jobs = list(jobs)
    pipe = conn.pipeline(transaction=together)
    for job in jobs:
        pipe.get(keys.job_config(job))
        pipe.get(keys.job_blocked(job))
        pipe.exists(keys.job_paused(job))
        pipe.get(keys.job_schedule(job))
        if leases:
            pipe.hgetall(keys.job_leases(job))
    answers = pipe.execute()

    def decode(answers: list[Any]) -> list[JobNow]:
        step = 5 if leases else 4
        return [JobNow(_config(a[0]), unpack(a[1], JobBlock) if a[1] else None, bool(a[2]), schedule_of(a[3]),
                       {b.decode(): lease_holder(v) for b, v in a[4].items()} if leases else {})
                for a in (answers[i:i + step] for i in range(0, len(answers), step))]

    if inspect.isawaitable(answers):
        async def later() -> list[JobNow]:
            return decode(await answers)
        return later()
    return decode(answers)


def _config(raw: bytes | None) -> JobConfig | None:
    try:
        return unpack(raw, JobConfig) if raw else None
    except msgspec.ValidationError:  # written by an incompatible genq
        return None


def pause(conn: redis.Redis, job: str | None = None) -> None:
    """`genq pause [--job]`: no worker sends a new request of any job, or of `job` (the flag holds when)."""
    conn.set(keys.PAUSED if job is None else keys.job_paused(job), repr(time.time()))


def resume(conn: redis.Redis, job: str | None = None) -> None:
    """`genq resume [--job]`: the fleet-wide pause, or the job's block and pause, lifted in one DEL."""
    conn.delete(*([keys.PAUSED] if job is None else [keys.job_blocked(job), keys.job_paused(job)]))


def paused_all(conn: redis.Redis) -> bool:
    return bool(conn.exists(keys.PAUSED))


async def block_job(conn: aioredis.Redis, job: str, record: JobBlock) -> None:
    """Block the job (the first reason stored wins) and pause it, in one transaction."""
    async with conn.pipeline(transaction=True) as pipe:
        pipe.set(keys.job_blocked(job), pack(record), nx=True)
        pipe.set(keys.job_paused(job), repr(time.time()))
        await pipe.execute()


async def job_names(conn: aioredis.Redis) -> list[str]:
    return [j.decode() for j in await conn.smembers(keys.JOBS)]


def schedule_of(raw: bytes | None) -> JobSchedule:
    return unpack(raw, JobSchedule) if raw else JobSchedule()


def stage_schedules(pipe: Any, jobs: list[str]) -> None:
    """One MGET of these jobs' packed schedules (schedule_of reads each)."""
    pipe.mget([keys.job_schedule(j) for j in jobs])


def stage_schedule(pipe: Pipeline, job: str, schedule: JobSchedule) -> None:
    pipe.set(keys.job_schedule(job), pack(schedule))


def change_record(conn: redis.Redis, key: str, read: Callable[[bytes | None], R], change: Callable[[R], T],
                  also: Callable[[Pipeline], object] = lambda pipe: None) -> T:
    """Store change(read(the stored bytes)) under `key` under WATCH, with what `also` stages in the same
    transaction; `change` may raise to store nothing, or return what it was given: nothing to store."""
    def store(pipe: Pipeline) -> T:
        new = change(old := read(pipe.get(key)))
        pipe.multi()
        if new is not old:
            pipe.set(key, pack(new))
            also(pipe)
        return new

    return conn.transaction(store, key, value_from_callable=True)


def change_schedule(conn: redis.Redis, job: str, change: Callable[[JobSchedule], JobSchedule],
                    paused: bool | None = None) -> JobSchedule:
    """The job's schedule changed; paused True/False: the job paused or not in the same transaction (its block
    left), so that Redis's pauses and resumes come in the order of their versions, as job.json keeps them."""
    def also(pipe: Pipeline) -> None:
        if paused:
            pause(pipe, job)
        elif paused is not None:
            pipe.delete(keys.job_paused(job))

    return change_record(conn, keys.job_schedule(job), schedule_of, change, also)


def change_config(conn: redis.Redis, job: str, change: Callable[[JobConfig | None], JobConfig]) -> JobConfig:
    return change_record(conn, keys.job_config(job), lambda raw: unpack(raw, JobConfig) if raw else None, change)


async def pin_model(conn: aioredis.Redis, job: str, model: str, auto: str) -> tuple[JobConfig | None, bool]:
    """The job's config with model `auto` pinned to `model` unless another engine did first, and whether
    this call pinned it; (None, False) if the job is gone."""
    key = keys.job_config(job)

    async def pin(pipe: Any) -> tuple[JobConfig | None, bool]:
        raw = await pipe.get(key)
        config = unpack(raw, JobConfig) if raw else None
        if config is None or config.model != auto:
            return config, False
        pipe.multi()
        pipe.set(key, pack(pinned := msgspec.structs.replace(config, model=model)))
        return pinned, True

    return await conn.transaction(pin, key, value_from_callable=True)


@dataclass
class JobCounts:
    total: int  # prompts enqueued (less those purged)
    batches_total: int  # batches written (the ledger's list)
    batches: int  # batches counted in the job's stats (less those purged)
    done: int  # batches whose shard is written
    dead: int  # dead letters
    completed: int = 0  # prompts its workers finished (read with `fleet`)
    inflight: dict[str, InFlight] = field(default_factory=dict)  # of `fleet`, the workers on it now


def counts(conn: redis.Redis, job: str, fleet: list[str] | None = None) -> JobCounts:
    """The job's counts; given the fleet's worker names (`genq jobs`), also its workers' figures."""
    workers = [] if fleet is None else sorted(w.decode() for w in conn.smembers(keys.job_workers(job)))
    with conn.pipeline(transaction=False) as pipe:
        pipe.hmget(keys.job_stats(job), ["total", "batches"])
        pipe.zcard(keys.job_batches(job))
        pipe.scard(keys.job_done(job))
        pipe.hlen(keys.job_dlq(job))
        for w in workers:
            pipe.hget(keys.worker_stats(job, w), "done")
        for w in fleet or []:
            pipe.get(keys.job_inflight(job, w))
        (total, batches), listed, done, dead, *rest = pipe.execute()
    return JobCounts(total=int(total or 0), batches_total=int(listed), batches=int(batches or 0), done=int(done),
                     dead=int(dead), completed=sum(int(v or 0) for v in rest[:len(workers)]),
                     inflight={w: unpack(raw, InFlight) for w, raw in zip(fleet or [], rest[len(workers):]) if raw})


def batches_counted(conn: redis.Redis, jobs: list[str]) -> list[int]:
    """Each job's count of batches ever queued, in one round trip."""
    with conn.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.hget(keys.job_stats(job), "batches")
        return [int(n or 0) for n in pipe.execute()]


def done_batches(conn: redis.Redis, job: str) -> set[str]:
    return {b.decode() for b in conn.smembers(keys.job_done(job))}


def all_batches(conn: redis.Redis, job: str) -> set[str]:
    return {b.decode() for b in conn.zrange(keys.job_batches(job), 0, -1)}


def prompt_batch(conn: redis.Redis, job: str, prompt_id: str) -> tuple[bool, str | None]:
    """Whether the id index knows the prompt, and the batch it names (None in an entry of an older genq)."""
    value = conn.hget(keys.job_ids(job), prompt_id)
    return value is not None, None if value is None else scripts.indexed_batch(value)


def shard_infos(conn: redis.Redis, job: str, batches: list[str] | None = None) -> list[bytes]:
    """The ShardInfo of each written batch, or of those of `batches` that are written."""
    if batches is None:
        return conn.hvals(keys.job_shards(job))
    return [raw for raw in conn.hmget(keys.job_shards(job), batches) if raw is not None]


def watch_enqueue(pipe: Pipeline, job: str) -> None:
    """WATCH what an enqueue reads before it writes: the id index, the batch numbering, the config."""
    pipe.watch(keys.job_ids(job), keys.job_batch_seq(job), keys.job_config(job))


def last_batch_number(conn: redis.Redis, job: str) -> int:
    return int(conn.get(keys.job_batch_seq(job)) or 0)


def stage_last_batch_number(pipe: Pipeline, job: str, number: int) -> None:
    pipe.set(keys.job_batch_seq(job), number)


job_keys_shown = keys.job_keys_pattern


def find_job_keys(conn: redis.Redis, job: str) -> list[str]:
    return sorted(k.decode() for k in conn.scan_iter(match=keys.job_keys_pattern(job), count=1000))


def stage_forget_job(pipe: Pipeline, job: str, job_keys: list[str]) -> None:
    if job_keys:
        pipe.delete(*job_keys)
    pipe.srem(keys.JOBS, job)


def batch_exists(conn: redis.Redis, job: str, batch: str) -> bool:
    """Whether the batch's record is stored (deleted once its shard is written, or with its job)."""
    return bool(conn.exists(keys.batch(job, batch)))


def batch_done(conn: redis.Redis, job: str, batch: str) -> bool:
    return bool(conn.sismember(keys.job_done(job), batch))


def result_count(conn: redis.Redis, job: str, batch: str) -> int:
    """Results stored for the batch, not yet in a shard."""
    return int(conn.hlen(keys.batch_results(job, batch)))


def result_ids(conn: redis.Redis, job: str, batch: str) -> set[str]:
    return {k.decode() for k in conn.hkeys(keys.batch_results(job, batch))}
