"""What an engine reads and writes, from its event loop, of the jobs whose batches it holds: block and
pause flags and settings (worker/gate.py), other engines' leases and their jobs' priorities
(worker/stealing.py), schedules (worker/shares.py); one round trip each."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import redis.asyncio as aioredis

from genq.core import keys
from genq.core.ledger import lease_holder
from genq.core.ledger.jobs import schedule_of
from genq.core.records import JobBlock, JobConfig, JobSchedule, pack, unpack


def _config(raw: bytes | None) -> JobConfig | None:
    return unpack(raw, JobConfig) if raw is not None else None


async def arrival_state(conn: aioredis.Redis, job: str) -> tuple[bool, JobConfig | None, bool]:
    """What a leased batch's job is now: blocked, its settings (None: deleted), paused."""
    async with conn.pipeline(transaction=False) as pipe:
        pipe.exists(keys.job_blocked(job))
        pipe.get(keys.job_config(job))
        pipe.exists(keys.job_paused(job))
        blocked, raw, paused = await pipe.execute()
    return bool(blocked), _config(raw), bool(paused)


async def blocks_and_configs(conn: aioredis.Redis, jobs: list[str]) -> list[tuple[bool, JobConfig | None]]:
    """For each job, in order: whether it is blocked, and its settings (None: deleted)."""
    async with conn.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.exists(keys.job_blocked(job))
            pipe.get(keys.job_config(job))
        answers = await pipe.execute()
    return [(bool(answers[2 * i]), _config(answers[2 * i + 1])) for i in range(len(jobs))]


async def block_job(conn: aioredis.Redis, job: str, record: JobBlock) -> None:
    """Block the job (the first reason stored wins) and pause it, in one transaction."""
    async with conn.pipeline(transaction=True) as pipe:
        pipe.set(keys.job_blocked(job), pack(record), nx=True)
        pipe.set(keys.job_paused(job), repr(time.time()))
        await pipe.execute()


async def job_names(conn: aioredis.Redis) -> list[str]:
    """Every job the ledger knows, unordered."""
    return [j.decode() for j in await conn.smembers(keys.JOBS)]


async def leases_and_configs(conn: aioredis.Redis, jobs: list[str]
                             ) -> list[tuple[JobConfig | None, dict[str, str | None]]]:
    """For each job, in order: its settings now (None: deleted, or written by an incompatible genq)
    and its leased batches, each with its holder (an engine instance)."""
    async with conn.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.hgetall(keys.job_leases(job))
            pipe.get(keys.job_config(job))
        answers = await pipe.execute()
    out: list[tuple[JobConfig | None, dict[str, str | None]]] = []
    for i in range(len(jobs)):
        leases, raw = answers[2 * i], answers[2 * i + 1]
        try:
            config = unpack(raw, JobConfig) if raw else None
        except msgspec.ValidationError:
            config = None
        out.append((config, {batch.decode(): lease_holder(value) for batch, value in leases.items()}))
    return out


async def unpaused_priorities(conn: aioredis.Redis, jobs: list[str]) -> dict[str, int]:
    """Of these jobs, those not paused, with their scheduling priority."""
    async with conn.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.get(keys.job_schedule(job))
            pipe.exists(keys.job_paused(job))
        answers = await pipe.execute()
    return {job: schedule_of(answers[2 * i]).priority for i, job in enumerate(jobs) if not answers[2 * i + 1]}


def stage_schedules(pipe: Any, jobs: list[str]) -> None:
    """Queue the read of these jobs' packed schedules on an asyncio pipeline (one MGET; schedule_of reads each)."""
    pipe.mget([keys.job_schedule(j) for j in jobs])


async def schedule_now(conn: aioredis.Redis, job: str) -> JobSchedule:
    return schedule_of(await conn.get(keys.job_schedule(job)))
