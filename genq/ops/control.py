"""Operator controls over Redis: the fleet view, pause/resume, drain, live concurrency, job list.

Everything here is plain synchronous Redis reads and writes so the CLI (genq.cli.control)
and the monitor can share it. Workers publish WorkerStatus (TTL 15 s, kept without TTL once
"stopped") and read their Control and the pause flags every second (genq.core.ledger.fleet and
.jobs keep them); nothing here talks to a worker directly.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import redis

from genq.core.health import NO_HEARTBEAT
from genq.core.ledger import fleet as ledger_fleet
from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger.figures import job_totals
from genq.core.order import schedules
from genq.core.queueing import carried, delete_rq_job, fetch_rq_jobs, list_jobs, suspend_loops
from genq.core.records import Control, JobBlock, JobConfig, WorkerStatus
from genq.core.state import JobStatus, job_status
from genq.ops.settings import blocks_of, unblock, unqueue
from genq.output import truth
from genq.output.sink import open_store

LOST = "lost"  # in the fleet's list, but its status key expired: the process died without saying so
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
        "tok_per_s": 0.0, "req_per_s": 0.0, "done": 0, "errors": 0, "model": None, "server_capacity": None}
    # server_capacity: the requests its server runs at once (vLLM's max_num_seqs, 128 by default;
    # None: not known yet); concurrency_limit: the operator's cap on this worker (None: auto, follow
    # the server). "cap" is concurrency_limit's first name, kept for scripts that read it.
    JSON_FIELDS: ClassVar[tuple[str, ...]] = (
        "name", "state", "host", "gpu", "server", "pid", "batches", "in_flight", "target", "concurrency_limit",
        "server_capacity", "cap", "queued", "tok_per_s", "req_per_s", "done", "errors", "heartbeat_age_s", "note",
        "model")

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
    def concurrency_limit(self) -> int | None:
        """The live concurrency cap (`genq concurrency`; None: auto)."""
        return None if self.status is None else self.status.concurrency_limit

    cap = concurrency_limit

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
    now = time.time()
    # A status written by an incompatible genq reads as None: unknown.
    return sorted((WorkerRow(name, status, now) for name, status in ledger_fleet.statuses(conn).items()),
                  key=_sort_key)


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
    def change(control: Control) -> None:
        if drain is not None:
            control.drain = drain
        if concurrency is not KEEP:
            control.concurrency = concurrency or None  # type: ignore[assignment]  # int | None, not KEEP

    control = ledger_fleet.change_control(conn, name, change)
    tell_idle_workers(conn)
    return control


def tell_idle_workers(conn: redis.Redis) -> None:
    """Idle workers read their control every 20 s: this makes them read it now (one PUBLISH)."""
    ledger_fleet.tell_idle_workers(conn)


def pause(conn: redis.Redis, job: str | None = None) -> None:
    """Stop dispatching new requests (all jobs, or one); in-flight requests finish."""
    if job is None:
        ledger_jobs.pause_all(conn)
        suspend_loops(conn)  # as `rq suspend`: RQ work loops (ours or stock) take no new batch
    else:
        # Its queued batches leave RQ's queue and its workers park what they hold (worker/parking.py):
        # their slots go to other jobs; `resume --job` queues them all again.
        ledger_jobs.pause_job(conn, job)
        unqueue(conn, job)
    tell_idle_workers(conn)


def resume(conn: redis.Redis, job: str | None = None) -> int:
    """Undo a pause; with a job, also lift its block and queue the batches its workers parked
    (genq.ops.settings.unblock): how many were queued."""
    if job is None:
        ledger_jobs.resume_all(conn)
        suspend_loops(conn, suspended=False)
        queued = 0
    else:
        queued = unblock(conn, job)
    tell_idle_workers(conn)
    return queued


def paused_jobs(conn: redis.Redis, jobs: Iterable[str]) -> set[str]:
    return ledger_jobs.paused_jobs(conn, jobs)


def globally_paused(conn: redis.Redis) -> bool:
    return ledger_jobs.paused_all(conn)


def job_rows(conn: redis.Redis, names: Iterable[str] | None = None) -> list[JobRow]:
    """Totals per job from the counters of record (genq.core.ledger.figures says which counter is the truth of each)."""
    from genq.core.queueing import load_config

    names = list_jobs(conn) if names is None else list(names)
    paused_all = globally_paused(conn)
    paused = paused_jobs(conn, names)
    fleet_names = ledger_fleet.worker_names(conn)
    blocks = blocks_of(conn, names)
    sched = schedules(conn, names)
    rows = []
    for job in names:
        totals = job_totals(conn, job, fleet_names)
        stats, failed, batches_done, done = totals.stats, totals.dead, totals.batches_done, totals.done
        holding = list(totals.inflight)
        running = sum(len(record.tokens) for record in totals.inflight.values())
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
    statuses = ledger_fleet.statuses(conn, fleet_names).values()
    fleet_running = sum(s.in_flight for s in statuses if s is not None and s.state != "stopped")  # every job's, as the monitor counts
    for r in rows:
        r.share = min(1.0, r.running / fleet_running) if fleet_running else 0.0
    return rows


def forget(conn: redis.Redis, names: Iterable[str]) -> list[str]:
    """Remove workers from the fleet view (their status and control records too)."""
    names = list(names)
    ledger_fleet.forget_workers(conn, names)
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


def mark_output_deleted(config: JobConfig | None) -> str | None:
    """OUTPUT/JOB/job.json marked deleted, so the name's next enqueue starts a new job instead of
    taking this one up again from its shards (genq recover still can). Why it could not, or None."""
    if config is None:
        return None
    try:
        truth.mark_deleted(open_store(config.output, config.s3_endpoint_url), config.name, time.time(),
                           config.incarnation)
    except Exception as exc:  # OSError, botocore's: the output is not reachable from here
        return (f"could not mark {config.output}/{config.name}/job.json deleted ({type(exc).__name__}: {exc}): "
                f"an enqueue of the name {config.name} will take the old job up again from its shards")
    return None


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
    found_keys = ledger_jobs.find_job_keys(conn, job)
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
        ledger_jobs.stage_forget_job(pipe, found.job, found.keys)
        pipe.execute()
    if again:
        # A batch RQ re-queued or a worker wrote meanwhile would be orphaned: one more pass catches it.
        late = find_job(conn, found.job)
        if late.keys or late.rq_jobs:
            delete_job(conn, late, again=False)
