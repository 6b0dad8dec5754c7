"""The fleet's records in Redis: workers, their statuses and controls, their requests in flight per job,
the wake-up channel, and what genq keeps of a server. `stage_*` only queue commands on a pipeline."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import redis
import redis.asyncio as aioredis

from genq.core import keys
from genq.core.ledger.jobs import change_record
from genq.core.records import Control, InFlight, ServerDecode, WorkerStatus, pack, unpack


def worker_names(conn: redis.Redis) -> list[str]:
    """Every worker that ever heartbeated (until `genq workers forget`), sorted."""
    return sorted(n.decode() for n in conn.smembers(keys.WORKERS))


def statuses(conn: redis.Redis | aioredis.Redis, names: list[str] | None = None) -> Any:
    """Each worker's status (of `names`, else of all), None when expired (lost) or unreadable; an awaitable on an
    asyncio client."""
    if isinstance(conn, aioredis.Redis):
        async def read() -> dict[str, WorkerStatus | None]:
            found = sorted(n.decode() for n in await conn.smembers(keys.WORKERS)) if names is None else names
            raws = await conn.mget([keys.worker_status(n) for n in found]) if found else []
            return dict(zip(found, map(_status, raws)))
        return read()
    found = worker_names(conn) if names is None else names
    return dict(zip(found, map(_status, conn.mget([keys.worker_status(n) for n in found]) if found else [])))


def _status(raw: bytes | None) -> WorkerStatus | None:
    try:
        return unpack(raw, WorkerStatus) if raw else None
    except msgspec.DecodeError:  # written by an incompatible genq
        return None


def forget_workers(conn: redis.Redis, names: list[str]) -> None:
    if names:
        with conn.pipeline() as pipe:
            pipe.srem(keys.WORKERS, *names)
            pipe.delete(*[keys.worker_status(n) for n in names], *[keys.worker_control(n) for n in names])
            pipe.execute()


def stage_beat(pipe: Any, status: WorkerStatus, instance: str, ttl: int, status_ttl: int, *, member: bool,
               inflight: list[InFlight], gone: Iterable[str], inflight_ttl: int, first: bool = False) -> None:
    """A beat: the engine alive `ttl` s more, its status (a stopped one's kept without TTL: stopped, not lost), its
    membership, its requests in flight per job (none for `gone`); a life's first drops an earlier life's Control."""
    stopped = status.state == "stopped"
    if first:
        pipe.delete(keys.worker_control(status.name))
    if not stopped:
        pipe.set(keys.engine_alive(instance), status.name, ex=ttl)
    pipe.set(keys.worker_status(status.name), pack(status), ex=None if stopped else status_ttl)
    if member:
        pipe.sadd(keys.WORKERS, status.name)
    for record in inflight:
        pipe.set(keys.job_inflight(record.job, record.worker), pack(record), ex=inflight_ttl)
    for job in gone:
        pipe.delete(keys.job_inflight(job, status.name))


async def stopped(conn: aioredis.Redis, instance: str, name: str) -> None:
    await conn.delete(keys.engine_alive(instance), keys.worker_control(name))


async def read_controls(conn: aioredis.Redis, name: str, jobs: list[str]) -> tuple[Control, bool, set[str]]:
    """This worker's Control, the fleet-wide pause, and which of `jobs` are paused; one round trip."""
    async with conn.pipeline(transaction=False) as pipe:
        pipe.get(keys.worker_control(name))
        pipe.exists(keys.PAUSED)
        for job in jobs:
            pipe.exists(keys.job_paused(job))
        raw, paused, *job_flags = await pipe.execute()
    control = unpack(raw, Control) if raw else Control()
    return control, bool(paused), {job for job, flag in zip(jobs, job_flags) if flag}


def control_of(conn: redis.Redis, name: str) -> Control:
    raw = conn.get(keys.worker_control(name))
    return unpack(raw, Control) if raw else Control()


def change_control(conn: redis.Redis, name: str, change: Callable[[Control], None]) -> Control:
    """Apply change() to the worker's stored Control under WATCH."""
    def changed(stored: Control) -> Control:
        control = msgspec.structs.replace(stored)  # a copy: change_record stores a record other than the one read
        change(control)
        return control

    return change_record(conn, keys.worker_control(name), lambda raw: unpack(raw, Control) if raw else Control(),
                         changed)


def tell_idle_workers(conn: redis.Redis | aioredis.Redis) -> Any:
    """Every idle worker reads its control and beats now, not at its 20 s pace; an awaitable on an asyncio client."""
    return conn.publish(keys.WAKE, keys.WAKE_CONTROL)


async def wake_for_work(conn: aioredis.Redis) -> None:
    await conn.publish(keys.WAKE, b"1")


def listen_for_wakes(pubsub: Any) -> Callable[[Any], str]:
    """Subscribe to the wake-up channel; what a message says: "control", "queued" or "work"."""
    pubsub.subscribe(keys.WAKE)
    return lambda data: {keys.WAKE_CONTROL: "control", keys.WAKE_QUEUED: "queued"}.get(data, "work")


async def server_decode(conn: aioredis.Redis, server: str, model: str) -> ServerDecode | None:
    raw = await conn.get(keys.server_decode(server, model))
    return unpack(raw, ServerDecode) if raw else None


def stage_server_decode(pipe: Any, server: str, model: str, figures: ServerDecode, ttl: int) -> None:
    pipe.set(keys.server_decode(server, model), pack(figures), ex=ttl)
