"""Dead letters: one DeadLetter per failed prompt id, written by RECORD, read or moved here; a change runs
under WATCH of the job's letters (transaction)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import msgspec
import redis
from redis.client import Pipeline

from genq.core import keys
from genq.core.records import DeadLetter

L = TypeVar("L", bound=msgspec.Struct)  # DeadLetter, or a view of it (genq.ops.dlq.Entry)
T = TypeVar("T")


def count(conn: redis.Redis, job: str) -> int:
    return int(conn.hlen(keys.job_dlq(job)))


def scan_raw(conn: redis.Redis, job: str, step: int = 500) -> Iterator[bytes]:
    """Every letter of the job, packed, read in steps (HSCAN)."""
    return (raw for _, raw in conn.hscan_iter(keys.job_dlq(job), count=step))


def read_all(conn: redis.Redis, job: str, as_type: type[L]) -> list[L]:
    return [msgspec.msgpack.decode(raw, type=as_type) for raw in scan_raw(conn, job)]


def read_some(conn: redis.Redis, job: str, ids: Sequence[str], as_type: type[L]) -> list[L | None]:
    """The letters of these prompt ids (None: no letter), in order."""
    if not ids:
        return []
    return [msgspec.msgpack.decode(raw, type=as_type) if raw is not None else None
            for raw in conn.hmget(keys.job_dlq(job), list(ids))]


def transaction(conn: redis.Redis, job: str, body: Callable[[Any], T], *, batch: str | None = None,
                also: Iterable[str] = ()) -> T:
    """body(pipe) under WATCH of the job's letters (and `batch`'s results, and `also`), again on a change."""
    watched = [*also, keys.job_dlq(job), *([keys.batch_results(job, batch)] if batch is not None else [])]
    return conn.transaction(body, *watched, value_from_callable=True)


def stage_drop(pipe: Pipeline, job: str, dropped: Sequence[DeadLetter]) -> None:
    """These letters out of the DLQ, and off the counter of the worker that wrote each (its `failed`: its
    letters stored, as the job's failed is the DLQ's size)."""
    if dropped:
        pipe.hdel(keys.job_dlq(job), *(d.id for d in dropped))
    for worker, n in Counter(d.worker for d in dropped).items():
        pipe.hincrby(keys.worker_stats(job, worker), "failed", -n)


def stage_forget_prompts(pipe: Pipeline, job: str, ids: list[str]) -> None:
    """Forget these prompts (an enqueue of them queues them anew); counted as purged."""
    if ids:
        pipe.hdel(keys.job_ids(job), *ids)
        pipe.hincrby(keys.job_stats(job), "total", -len(ids))
        pipe.hincrby(keys.job_stats(job), "purged", len(ids))


def stage_forget_batch(pipe: Pipeline, job: str, batch: str, *, had_record: bool) -> None:
    pipe.zrem(keys.job_batches(job), batch)
    pipe.hdel(keys.job_transport(job), batch)
    pipe.hdel(keys.job_leases(job), batch)
    if had_record:
        pipe.delete(keys.batch(job, batch), keys.batch_claims(job, batch), keys.batch_tries(job, batch))
        pipe.hincrby(keys.job_stats(job), "batches", -1)
