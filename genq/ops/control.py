"""Operator controls over Redis: the fleet view, pause/resume, drain, live concurrency, job list.

Everything here is plain synchronous Redis reads and writes so the CLI (genq.cli.control)
and the monitor can share it. Workers publish WorkerStatus (keys.worker_status, TTL 15 s,
kept without TTL once "stopped") and read Control (keys.worker_control), keys.PAUSED and
keys.job_paused every second; nothing here talks to a worker directly.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import redis

from genq.core import keys
from genq.core.health import NO_HEARTBEAT
from genq.core.order import schedules
from genq.core.queueing import carried, delete_rq_job, fetch_rq_jobs, list_jobs, suspend_loops
from genq.core.records import Control, InFlight, JobBlock, WorkerStatus, pack, unpack
from genq.core.state import JobStatus, job_status
from genq.ops.settings import blocks_of, unblock, unqueue

LOST = "lost"  # in keys.WORKERS, but its status key expired: the process died without saying so
GONE_STATES = ("stopped", LOST)  # workers that will not act on a Control record


@dataclass(frozen=True)
class WorkerRow:
    """One line of the fleet view (`genq workers`): the worker's own record (None once its
    heartbeat expired: lost) and what is derived from it; no field is copied."""

    name: str
    status: WorkerStatus | None
    now: float

    # Read through from the record (defaults while lost).
    _DEFAULTS: ClassVar[dict[str, Any]] = {
        "host": None, "gpu": None, "server": None, "pid": None, "in_flight": 0, "queued": 0,
        "tok_per_s": 0.0, "req_per_s": 0.0, "done": 0, "errors": 0, "model": None}
    JSON_FIELDS: ClassVar[tuple[str, ...]] = (
        "name", "state", "host", "gpu", "server", "pid", "batches", "in_flight", "target", "cap", "queued",
        "tok_per_s", "req_per_s", "done", "errors", "heartbeat_age_s", "note", "model")

    def __getattr__(self, field: str) -> Any:
        if field not in self._DEFAULTS:
            raise AttributeError(field)
        return self._DEFAULTS[field] if self.status is None else getattr(self.status, field)

    @property
    def state(self) -> str:
        return LOST if self.status is None else self.status.state

    @property
    def live(self) -> bool:
        return self.state not in GONE_STATES

    @property
    def batches(self) -> list[str]:
        return [] if self.status is None else [str(b) for b in self.status.batches]

    @property
    def target(self) -> int:
        return 0 if self.status is None else self.status.concurrency_target

    @property
    def cap(self) -> int | None:
        """The live concurrency cap (None: auto)."""
        return None if self.status is None else self.status.concurrency_limit

    @property
    def heartbeat_age_s(self) -> float | None:
        return None if self.status is None else round(max(0.0, self.now - self.status.heartbeat_at), 1)

    @property
    def note(self) -> str | None:
        s = self.status
        if s is None:
            return f"{NO_HEARTBEAT}; its batches are queued again"
        return s.note or (s.gpu_note if s.state == "server_down" else None)

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.JSON_FIELDS}


class JobRow(msgspec.Struct, omit_defaults=False):
    """One line of `genq jobs`."""

    name: str
    state: JobStatus
    paused: bool
    total: int
    done: int
    failed: int
    remaining: int
    batches: int
    batches_done: int
    workers: list[str] = []  # workers holding work of this job right now
    output: str | None = None
    blocked: JobBlock | None = None  # why its settings stopped it (docs/settings.md)
    settings_version: int = 1
    priority: int = 0  # its JobSchedule (docs/scheduling.md)
    weight: float = 1.0
    running: int = 0  # its requests running on the fleet now
    share: float = 0.0  # of the fleet's running requests now, this job's (0..1)


def _sort_key(row: WorkerRow) -> tuple:
    gpu = int(row.gpu) if row.gpu is not None and row.gpu.isdigit() else -1
    return (row.host is None, row.host or "", gpu, row.name)


def fleet(conn: redis.Redis) -> list[WorkerRow]:
    """Every worker that ever heartbeated, sorted by host then GPU."""
    names = sorted(n.decode() for n in conn.smembers(keys.WORKERS))
    if not names:
        return []
    raws = conn.mget([keys.worker_status(n) for n in names])
    now = time.time()
    rows = []
    for name, raw in zip(names, raws):
        try:
            status = unpack(raw, WorkerStatus) if raw else None
        except msgspec.DecodeError:
            status = None  # written by an incompatible genq: treat as unknown
        rows.append(WorkerRow(name, status, now))
    return sorted(rows, key=_sort_key)


class NoMatch(Exception):
    """A selector (--worker/--host) matched no live worker; the message says what exists."""


def select(rows: Iterable[WorkerRow], *, workers: Iterable[str] = (), host: str | None = None,
           everyone: bool = False) -> list[WorkerRow]:
    """The live workers an operator named; raises NoMatch with a helpful message."""
    rows = list(rows)
    live = [r for r in rows if r.live]
    if everyone:
        return live
    if host is not None:
        chosen = [r for r in live if r.host == host]
        if not chosen:
            hosts = sorted({r.host for r in live if r.host})
            raise NoMatch(f"no live worker on host {host!r}; live hosts: {', '.join(hosts) or 'none'}")
        return chosen
    by_name = {r.name: r for r in rows}
    chosen = []
    for name in workers:
        row = by_name.get(name)
        if row is None:
            raise NoMatch(f"no worker named {name!r}; known: {', '.join(sorted(by_name)) or 'none'}")
        if not row.live:
            raise NoMatch(f"worker {name!r} is {row.state}; it cannot take instructions")
        chosen.append(row)
    return chosen


KEEP = object()  # update_control: leave this field as it is


def update_control(conn: redis.Redis, name: str, *, drain: bool | None = None,
                   concurrency: object = KEEP) -> Control:
    """Change one field of a worker's Control record and keep the others.

    concurrency=None (or 0) means auto; leave it as KEEP to keep the current value.
    WATCH makes a concurrent drain and concurrency change both stick.
    """
    key = keys.worker_control(name)
    result: list[Control] = []

    def change(pipe: redis.client.Pipeline) -> None:
        raw = pipe.get(key)
        control = unpack(raw, Control) if raw else Control()
        if drain is not None:
            control.drain = drain
        if concurrency is not KEEP:
            control.concurrency = concurrency or None
        pipe.multi()
        pipe.set(key, pack(control))
        result[:] = [control]

    conn.transaction(change, key)
    tell_idle_workers(conn)
    return result[0]


def tell_idle_workers(conn: redis.Redis) -> None:
    """Idle workers read their control every 20 s: this makes them read it now (one PUBLISH)."""
    conn.publish(keys.WAKE, keys.WAKE_CONTROL)


def pause(conn: redis.Redis, job: str | None = None) -> None:
    """Stop dispatching new requests (all jobs, or one); in-flight requests finish."""
    if job is None:
        with conn.pipeline() as pipe:
            pipe.set(keys.PAUSED, repr(time.time()))
            pipe.execute()
        suspend_loops(conn)  # as `rq suspend`: RQ work loops (ours or stock) take no new batch
    else:
        # Its queued batches leave RQ's queue and its workers park what they hold (worker/parking.py):
        # their slots go to other jobs; `resume --job` queues them all again.
        conn.set(keys.job_paused(job), repr(time.time()))
        unqueue(conn, job)
    tell_idle_workers(conn)


def resume(conn: redis.Redis, job: str | None = None) -> int:
    """Undo a pause; with a job, also lift its block and queue the batches its workers parked
    (genq.ops.settings.unblock): how many were queued."""
    if job is None:
        conn.delete(keys.PAUSED)
        suspend_loops(conn, suspended=False)
        queued = 0
    else:
        queued = unblock(conn, job)
    tell_idle_workers(conn)
    return queued


def paused_jobs(conn: redis.Redis, jobs: Iterable[str]) -> set[str]:
    jobs = list(jobs)
    if not jobs:
        return set()
    with conn.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.exists(keys.job_paused(job))
        flags = pipe.execute()
    return {job for job, flag in zip(jobs, flags) if flag}


def globally_paused(conn: redis.Redis) -> bool:
    return bool(conn.exists(keys.PAUSED))


def job_rows(conn: redis.Redis, names: Iterable[str] | None = None) -> list[JobRow]:
    """Totals per job from the counters of record (genq.monitor.snapshot says which counter is the truth of each)."""
    from genq.core.queueing import load_config

    names = list_jobs(conn) if names is None else list(names)
    paused_all = globally_paused(conn)
    paused = paused_jobs(conn, names)
    fleet_names = sorted(n.decode() for n in conn.smembers(keys.WORKERS))
    blocks = blocks_of(conn, names)
    sched = schedules(conn, names)
    rows = []
    for job in names:
        workers = sorted(w.decode() for w in conn.smembers(keys.job_workers(job)))
        with conn.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.job_stats(job))
            pipe.hlen(keys.job_dlq(job))
            pipe.scard(keys.job_done(job))
            for w in workers:
                pipe.hget(keys.worker_stats(job, w), "done")
            for w in fleet_names:
                pipe.get(keys.job_inflight(job, w))
            stats, failed, batches_done, *rest = pipe.execute()
        done = sum(int(v or 0) for v in rest[: len(workers)])
        holding = [w for w, raw in zip(fleet_names, rest[len(workers):]) if raw]
        running = sum(len(unpack(raw, InFlight).tokens) for raw in rest[len(workers):] if raw)
        total = int(stats.get(b"total", 0))
        batches = int(stats.get(b"batches", 0))
        is_paused = paused_all or job in paused
        state = job_status(total=total, finished=done + failed, batches=batches, batches_done=batches_done,
                           paused=is_paused, started=bool(holding) or done + failed > 0, failed=failed,
                           blocked=job in blocks)
        config = load_config(conn, job)
        rows.append(JobRow(
            name=job, state=state, paused=is_paused, total=total, done=done, failed=failed,
            remaining=max(0, total - done - failed), batches=batches, batches_done=batches_done,
            workers=holding, output=config.output if config else None, blocked=blocks.get(job),
            settings_version=config.settings_version if config else 1,
            priority=sched[job].priority, weight=sched[job].weight, running=running,
        ))
    statuses = [unpack(raw, WorkerStatus) for raw in conn.mget([keys.worker_status(w) for w in fleet_names])
                if raw] if fleet_names else []
    fleet_running = sum(s.in_flight for s in statuses if s.state != "stopped")  # every job's, as the monitor counts
    for r in rows:
        r.share = min(1.0, r.running / fleet_running) if fleet_running else 0.0
    return rows


def forget(conn: redis.Redis, names: Iterable[str]) -> list[str]:
    """Remove workers from the fleet view (their status and control records too)."""
    names = list(names)
    if names:
        with conn.pipeline() as pipe:
            pipe.srem(keys.WORKERS, *names)
            pipe.delete(*[keys.worker_status(n) for n in names], *[keys.worker_control(n) for n in names])
            pipe.execute()
    return names


# ---------------------------------------------------------------- deleting a job


class JobDeletion(msgspec.Struct):
    """What `genq jobs delete` found (and removed) for one job."""

    job: str
    keys: list[str]  # genq's keys of the job (everything under genq:job:JOB:)
    rq_jobs: dict[str, list[str]]  # where the job's RQ jobs are (queue, started, failed...) -> RQ job ids
    holders: list[str]  # live workers holding its batches

    @property
    def rq_count(self) -> int:
        return len({i for ids in self.rq_jobs.values() for i in ids})


def _rq_places(conn: redis.Redis) -> dict[str, Any]:
    """The queue `genq` and every registry of RQ's that can hold one of its jobs."""
    from genq.core.queueing import rq_queue

    queue = rq_queue(conn)
    return {
        "queued": queue,
        "started": queue.started_job_registry,
        "finished": queue.finished_job_registry,
        "failed": queue.failed_job_registry,
        "deferred": queue.deferred_job_registry,
        "scheduled": queue.scheduled_job_registry,
        "canceled": queue.canceled_job_registry,
    }


def find_job(conn: redis.Redis, job: str) -> JobDeletion:
    """Everything of `job` in Redis: its keys, its RQ jobs by place, the live workers holding its batches."""
    found_keys = sorted(k.decode() for k in conn.scan_iter(match=keys.job_keys_pattern(job), count=1000))
    rq_jobs: dict[str, list[str]] = {}
    for place, holder in _rq_places(conn).items():
        # cleanup=False: looking must not make RQ move jobs between registries.
        ids = holder.get_job_ids() if place == "queued" else holder.get_job_ids(cleanup=False)
        mine = [j.id for j in fetch_rq_jobs(conn, ids) if j is not None and (c := carried(j)) is not None and c[0] == job]
        if mine:
            rq_jobs[place] = mine
    holders = sorted(row.name for row in fleet(conn)
                     if row.live and any(b.split("/", 1)[0] == job for b in row.batches))
    return JobDeletion(job=job, keys=found_keys, rq_jobs=rq_jobs, holders=holders)


def delete_job(conn: redis.Redis, found: JobDeletion, *, again: bool = True) -> None:
    """Remove what find_job found: RQ jobs from the queue and every registry, then the job's keys and name."""
    places = _rq_places(conn)
    ids = sorted({i for ids in found.rq_jobs.values() for i in ids})
    with conn.pipeline() as pipe:
        for place, holder in places.items():
            mine = found.rq_jobs.get(place, [])
            if not mine:
                continue
            if place == "queued":
                for rq_id in mine:
                    holder.remove(rq_id, pipeline=pipe)
            else:
                # The started registry holds "job:execution" entries; the others plain job ids.
                wanted = set(mine)
                entries = [e for e in conn.zrange(holder.key, 0, -1) if holder.parse_job_id(e.decode()) in wanted]
                if entries:
                    pipe.zrem(holder.key, *entries)
        for rq_job in fetch_rq_jobs(conn, ids):
            if rq_job is not None:
                delete_rq_job(pipe, rq_job, remove_from_queue=False)
        if found.keys:
            pipe.delete(*found.keys)
        pipe.srem(keys.JOBS, found.job)
        pipe.execute()
    if again:
        # A batch RQ re-queued or a worker wrote meanwhile would be orphaned: one more pass catches it.
        late = find_job(conn, found.job)
        if late.keys or late.rq_jobs:
            delete_job(conn, late, again=False)
