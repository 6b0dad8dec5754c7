"""What the monitor reads of a job, each read one round trip however many workers and batches:
the job's counters of record, each worker's counters and in-flight record for it, and which of
its batches are held (genq.monitor.snapshot turns these into a JobSnapshot and says which
counter is the truth of what).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from genq.core import keys, scripts
from genq.core.ledger import jobs
from genq.core.records import InFlight, JobBlock, JobConfig, JobSchedule, unpack


@dataclass
class JobFacts:
    config: JobConfig | None
    stats: dict[bytes, bytes]  # the job's stats hash, shard totals included
    batches: int  # batches written
    done: int  # batches whose shard is written
    dead: int  # dead letters
    hist: dict[int, int]  # completion length bucket -> count
    workers: set[str]  # workers with counters for the job
    paused: bool  # the job, or the whole fleet
    shards: int
    block: JobBlock | None
    schedule: JobSchedule


def job_facts(conn: redis.Redis, job: str) -> JobFacts | None:
    """The job's counters of record; None when Redis has no such job."""
    with conn.pipeline(transaction=False) as pipe:
        pipe.get(keys.job_config(job))
        pipe.hgetall(keys.job_stats(job))
        pipe.zcard(keys.job_batches(job))
        pipe.scard(keys.job_done(job))
        pipe.hlen(keys.job_dlq(job))
        pipe.hgetall(keys.job_hist(job))
        pipe.smembers(keys.job_workers(job))
        pipe.exists(keys.job_paused(job))
        pipe.exists(keys.PAUSED)
        pipe.hlen(keys.job_shards(job))
        pipe.sismember(keys.JOBS, job)
        pipe.get(keys.job_blocked(job))
        pipe.get(keys.job_schedule(job))
        (raw_config, stats, n_batches, n_done, n_dlq, hist, workers, paused, paused_all, shards, known,
         raw_block, raw_schedule) = pipe.execute()
    if raw_config is None and not stats and not known:
        return None
    if shards and scripts.SHARD_RECORDS.encode() not in stats:
        # Shards written by a genq that kept no totals: count them once, and keep the totals.
        scripts.evaluate(conn, scripts.COUNT_SHARDS, scripts.count_shards_call(job))
        stats = jobs.job_stats(conn, job)
    return JobFacts(
        config=unpack(raw_config, JobConfig) if raw_config else None,
        stats=stats,
        batches=int(n_batches), done=int(n_done), dead=int(n_dlq),
        hist={int(b): int(n) for b, n in hist.items()},
        workers={w.decode() for w in workers}, paused=bool(paused) or bool(paused_all), shards=int(shards),
        block=unpack(raw_block, JobBlock) if raw_block else None, schedule=jobs.schedule_of(raw_schedule),
    )


def worker_figures(conn: redis.Redis, job: str, names: list[str]) -> list[tuple[dict[bytes, bytes], InFlight | None]]:
    """Each worker's counters for the job (done, failed, in_tok, out_tok, first_at, last_at) and
    its InFlight record for it (None: not working on it now)."""
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(keys.worker_stats(job, name))
            pipe.get(keys.job_inflight(job, name))
        replies = pipe.execute()
    return [(replies[2 * i], unpack(raw, InFlight) if (raw := replies[2 * i + 1]) else None)
            for i in range(len(names))]


@dataclass
class JobTotals:
    """A job's totals for its row in `genq jobs` (genq.ops.control.job_rows)."""

    stats: dict[bytes, bytes]  # the job's stats hash
    dead: int  # dead letters
    batches_done: int
    done: int  # prompts its workers finished (the sum of their "done" counters)
    inflight: dict[str, InFlight]  # of the given workers, those working on it now


def job_totals(conn: redis.Redis, job: str, fleet: list[str]) -> JobTotals:
    workers = sorted(w.decode() for w in conn.smembers(keys.job_workers(job)))
    with conn.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.job_stats(job))
        pipe.hlen(keys.job_dlq(job))
        pipe.scard(keys.job_done(job))
        for w in workers:
            pipe.hget(keys.worker_stats(job, w), "done")
        for w in fleet:
            pipe.get(keys.job_inflight(job, w))
        stats, dead, batches_done, *rest = pipe.execute()
    return JobTotals(stats=stats, dead=int(dead), batches_done=int(batches_done),
                     done=sum(int(v or 0) for v in rest[: len(workers)]),
                     inflight={w: unpack(raw, InFlight) for w, raw in zip(fleet, rest[len(workers):]) if raw})


def held_progress(conn: redis.Redis, job: str, batch_ids: list[str]) -> tuple[list[int | None], dict[str, str]]:
    """For each batch: how many results it has stored, None once its record is gone (written or
    deleted); and the job's current leases (batch -> "TOKEN INSTANCE": only batches in progress,
    so bounded by the fleet)."""
    with conn.pipeline(transaction=False) as pipe:
        for bid in batch_ids:
            pipe.exists(keys.batch(job, bid))
            pipe.hlen(keys.batch_results(job, bid))
        pipe.hgetall(keys.job_leases(job))
        *replies, leases = pipe.execute()
    stored = [int(replies[2 * i + 1]) if replies[2 * i] else None for i in range(len(batch_ids))]
    return stored, {b.decode(): v.decode() for b, v in leases.items()}


def live_held(conn: redis.Redis, job: str, leased: list[tuple[str, str]]) -> int:
    """Of these (batch, holder engine) pairs, how many batches still have their record and a
    holder that is alive."""
    if not leased:
        return 0
    with conn.pipeline(transaction=False) as pipe:
        for bid, holder in leased:
            pipe.exists(keys.engine_alive(holder))
            pipe.exists(keys.batch(job, bid))
        replies = pipe.execute()
    return sum(1 for i in range(len(leased)) if replies[2 * i] and replies[2 * i + 1])


def prompt_state(conn: redis.Redis, job: str, batch: str, prompt_id: str
                 ) -> tuple[bytes | None, bytes | None, bytes | None, bool]:
    """Where a prompt of a pending batch is (`genq status JOB ID`): its stored result (packed),
    its claim ("INSTANCE TOKEN"), its batch's current lease ("TOKEN INSTANCE"), and whether the
    job (or the whole fleet) is paused; one round trip."""
    with conn.pipeline(transaction=False) as pipe:
        pipe.hget(keys.batch_results(job, batch), prompt_id)
        pipe.hget(keys.batch_claims(job, batch), prompt_id)
        pipe.hget(keys.job_leases(job), batch)
        pipe.exists(keys.job_paused(job), keys.PAUSED)
        result, claim, lease, paused = pipe.execute()
    return result, claim, lease, bool(paused)
