"""Dead letters: a job's prompts that failed for good, one DeadLetter per prompt id, written by RECORD
and read or moved here (`genq dlq`, the monitor, export). A change to them runs under WATCH of the
job's letters (transaction): a concurrent requeue or purge of the same letters starts it over."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import msgspec
import redis
from redis.client import Pipeline

from genq.core import keys

L = TypeVar("L", bound=msgspec.Struct)  # DeadLetter, or a view of it (genq.ops.dlq.Entry)
T = TypeVar("T")


def count(conn: redis.Redis, job: str) -> int:
    return int(conn.hlen(keys.job_dlq(job)))


def scan_raw(conn: redis.Redis, job: str, step: int = 500) -> Iterator[bytes]:
    """Every letter of the job, packed; HSCAN: a huge DLQ is read in steps without blocking Redis."""
    return (raw for _, raw in conn.hscan_iter(keys.job_dlq(job), count=step))


def read_all(conn: redis.Redis, job: str, as_type: type[L]) -> list[L]:
    return [msgspec.msgpack.decode(raw, type=as_type) for raw in scan_raw(conn, job)]


def read_some(conn: redis.Redis, job: str, ids: Sequence[str], as_type: type[L]) -> list[L | None]:
    """The letters of these prompt ids (None: no letter), in order (on a pipeline under WATCH: read at once)."""
    if not ids:
        return []
    return [msgspec.msgpack.decode(raw, type=as_type) if raw is not None else None
            for raw in conn.hmget(keys.job_dlq(job), list(ids))]


def transaction(conn: redis.Redis, job: str, body: Callable[[Any], T], *, batch: str | None = None,
                also: Iterable[str] = ()) -> T:
    """Run body(pipe) with the job's letters (and `batch`'s stored results; `also`: RQ's keys) under
    WATCH, again whenever one of them changes before its MULTI executes."""
    watched = [*also, keys.job_dlq(job), *([keys.batch_results(job, batch)] if batch is not None else [])]
    return conn.transaction(body, *watched, value_from_callable=True)


def stage_drop(pipe: Pipeline, job: str, ids: list[str]) -> None:
    """Take these letters out of the DLQ (their prompts were queued again, or are forgotten)."""
    if ids:
        pipe.hdel(keys.job_dlq(job), *ids)


def stage_forget_prompts(pipe: Pipeline, job: str, ids: list[str]) -> None:
    """Forget these prompts: out of the job's id index (an enqueue of them queues them anew)
    and its total; counted as purged."""
    if ids:
        pipe.hdel(keys.job_ids(job), *ids)
        pipe.hincrby(keys.job_stats(job), "total", -len(ids))
        pipe.hincrby(keys.job_stats(job), "purged", len(ids))


def stage_forget_batch(pipe: Pipeline, job: str, batch: str, *, had_record: bool) -> None:
    """Take a batch out of the ledger: a purged batch is neither pending nor done."""
    pipe.zrem(keys.job_batches(job), batch)
    pipe.hdel(keys.job_transport(job), batch)
    pipe.hdel(keys.job_leases(job), batch)
    if had_record:
        pipe.delete(keys.batch(job, batch), keys.batch_claims(job, batch), keys.batch_tries(job, batch))
        pipe.hincrby(keys.job_stats(job), "batches", -1)
