"""The fleet and the jobs as operators see and steer them: `genq workers`, `drain`, `concurrency`,
`jobs`, `jobs delete`, `pause`, `resume`. Workers publish their WorkerStatus (TTL 15 s, kept without
TTL once stopped) and read their Control record and the pause flags every second."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import redis

from genq.core.decodebound import NO_HEARTBEAT
from genq.core.ledger import fleet as ledger_fleet
from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger import leasing
from genq.core.ledger.figures import JobStatus, job_status, job_totals
from genq.core.order import order_queue
from genq.core.queueing import carried, delete_rq_job, fetch_rq_jobs, list_jobs, rq_queue, suspend_loops
from genq.core.records import Control, JobBlock, JobConfig, WorkerStatus
from genq.ops import Refused
from genq.output import truth
from genq.output.truth import open_store

LOST = "lost"  # in the fleet's list, but its status key expired: the process died without saying so


@dataclass(frozen=True)
class WorkerRow:
    """One line of `genq workers`: the worker's own record (None once its heartbeat expired: lost),
    its fields read through (these defaults while lost), and what is derived from it."""

    name: str
    status: WorkerStatus | None
    now: float

    _DEFAULTS: ClassVar[dict[str, Any]] = {
        "host": None, "gpu": None, "server": None, "pid": None, "in_flight": 0, "queued": 0, "tok_per_s": 0.0,
        "req_per_s": 0.0, "done": 0, "errors": 0, "model": None, "server_capacity": None, "concurrency_limit": None,
        "concurrency_target": 0}
    # "cap" is concurrency_limit's first name, documented in docs/fleet.md.
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
        return self.state not in ("stopped", LOST)

    @property
    def batches(self) -> list[str]:
        return [] if self.status is None else [str(b) for b in self.status.batches]

    target = property(lambda self: self.concurrency_target)
    cap = property(lambda self: self.concurrency_limit)

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


def fleet(conn: redis.Redis) -> list[WorkerRow]:
    """Every worker that ever heartbeated, by host then GPU (a status written by an incompatible
    genq reads as None: lost)."""
    now = time.time()
    rows = [WorkerRow(name, status, now) for name, status in ledger_fleet.statuses(conn).items()]
    return sorted(rows, key=lambda r: (r.host is None, r.host or "", int(r.gpu) if (r.gpu or "").isdigit() else -1,
                                       r.name))


def select(rows: Iterable[WorkerRow], *, workers: Iterable[str] = (), host: str | None = None,
           everyone: bool = False) -> list[WorkerRow]:
    """The live workers an operator named; Refused says what exists when a name matches none."""
    rows = list(rows)
    live = [r for r in rows if r.live]
    if everyone:
        return live
    if host is not None:
        if chosen := [r for r in live if r.host == host]:
            return chosen
        hosts = sorted({r.host for r in live if r.host})
        raise Refused(f"no live worker on host {host!r}; live hosts: {', '.join(hosts) or 'none'}")
    by_name = {r.name: r for r in rows}
    for name in workers:
        if name not in by_name:
            raise Refused(f"no worker named {name!r}; known: {', '.join(sorted(by_name)) or 'none'}")
        if not by_name[name].live:
            raise Refused(f"worker {name!r} is {by_name[name].state}; it cannot take instructions")
    return [by_name[name] for name in workers]


def update_control(conn: redis.Redis, name: str, **change: Any) -> Control:
    """Set fields (drain, concurrency: None or 0 is auto) of a worker's Control record and keep the
    others (WATCH: a concurrent drain and concurrency change both stick)."""
    def apply(control: Control) -> None:
        for field, value in change.items():
            setattr(control, field, (value or None) if field == "concurrency" else value)

    control = ledger_fleet.change_control(conn, name, apply)
    ledger_fleet.tell_idle_workers(conn)  # idle workers read their control every 20 s: now, instead
    return control


def pause(conn: redis.Redis, job: str | None = None) -> None:
    """Stop dispatching new requests (all jobs, or one); in-flight requests finish."""
    if job is None:
        ledger_jobs.pause_all(conn)
        suspend_loops(conn)  # as `rq suspend`: no engine (TAKE) and no stock RQ worker takes a new batch
    else:
        # Its queued batches leave RQ's queue and its workers park what they hold: their slots
        # go to other jobs; `resume --job` queues them all again.
        ledger_jobs.pause_job(conn, job)
        leasing.unqueue(conn, job)
    ledger_fleet.tell_idle_workers(conn)


def resume(conn: redis.Redis, job: str | None = None) -> int:
    """Undo a pause; with a job, also lift its block and pause and queue its parked batches: how many."""
    queued = 0
    if job is None:
        ledger_jobs.resume_all(conn)
        suspend_loops(conn, suspended=False)
    else:
        ledger_jobs.lift_block(conn, job)
        if queued := leasing.requeue_parked(conn, job):
            order_queue(conn)  # queued at the front: in priority order again (genq.core.order)
    ledger_fleet.tell_idle_workers(conn)
    return queued


def job_rows(conn: redis.Redis, names: Iterable[str] | None = None) -> list[JobRow]:
    """Totals per job from the counters of record (genq.core.ledger.figures)."""
    names = list_jobs(conn) if names is None else list(names)
    paused_all = ledger_jobs.paused_all(conn)
    fleet_names = ledger_fleet.worker_names(conn)
    jobs_now = dict(zip(names, ledger_jobs.jobs_now(conn, names)))
    rows = []
    for job in names:
        t = job_totals(conn, job, fleet_names)
        total, batches = int(t.stats.get(b"total", 0)), int(t.stats.get(b"batches", 0))
        now = jobs_now[job]
        is_paused = paused_all or now.paused
        state = job_status(total=total, finished=t.done + t.dead, batches=batches, batches_done=t.batches_done,
                           paused=is_paused, started=bool(t.inflight) or t.done + t.dead > 0, failed=t.dead,
                           blocked=now.blocked is not None)
        config = now.config
        rows.append(JobRow(
            name=job, state=state, paused=is_paused, total=total, done=t.done, failed=t.dead,
            remaining=max(0, total - t.done - t.dead), batches=batches, batches_done=t.batches_done,
            workers=list(t.inflight), output=config.output if config else None, blocked=now.blocked,
            settings_version=config.settings_version if config else 1, priority=now.schedule.priority,
            weight=now.schedule.weight, running=sum(len(r.tokens) for r in t.inflight.values())))
    # Every job's requests running, as the monitor counts them.
    statuses = ledger_fleet.statuses(conn, fleet_names).values()
    fleet_running = sum(s.in_flight for s in statuses if s is not None and s.state != "stopped")
    for r in rows:
        r.share = min(1.0, r.running / fleet_running) if fleet_running else 0.0
    return rows


class JobDeletion(msgspec.Struct):
    """What `genq jobs delete` found (and removes) of one job."""

    job: str
    keys: list[str]  # genq's keys of the job (everything under genq:job:JOB:)
    rq_jobs: dict[str, list[str]]  # where the job's RQ jobs are (queued, started, failed...) -> RQ job ids
    holders: list[str]  # live workers holding its batches


def mark_output_deleted(config: JobConfig) -> str | None:
    """OUTPUT/JOB/job.json marked deleted, so the name's next enqueue starts a new job instead of
    taking this one up again from its shards (genq recover still can). Why it could not, or None."""
    try:
        truth.mark_deleted(open_store(config.output, config.s3_endpoint_url), config.name, time.time(),
                           config.incarnation)
    except Exception as exc:  # OSError, botocore's: the output is not reachable from here
        return (f"could not mark {config.output}/{config.name}/job.json deleted ({type(exc).__name__}: {exc}): "
                f"an enqueue of the name {config.name} will take the old job up again from its shards")
    return None


def _rq_places(conn: redis.Redis) -> dict[str, Any]:
    """The queue and every registry of RQ's that can hold one of its jobs."""
    q = rq_queue(conn)
    return {"queued": q, "started": q.started_job_registry, "finished": q.finished_job_registry,
            "failed": q.failed_job_registry, "deferred": q.deferred_job_registry,
            "scheduled": q.scheduled_job_registry, "canceled": q.canceled_job_registry}


def find_job(conn: redis.Redis, job: str) -> JobDeletion:
    """Everything of `job` in Redis: its keys, its RQ jobs by place, the live workers holding its batches."""
    rq_jobs: dict[str, list[str]] = {}
    for place, holder in _rq_places(conn).items():
        # cleanup=False: looking must not make RQ move jobs between registries.
        ids = holder.get_job_ids() if place == "queued" else holder.get_job_ids(cleanup=False)
        if mine := [j.id for j in fetch_rq_jobs(conn, ids) if j is not None and (c := carried(j)) and c[0] == job]:
            rq_jobs[place] = mine
    holders = sorted(r.name for r in fleet(conn) if r.live and any(b.split("/", 1)[0] == job for b in r.batches))
    return JobDeletion(job=job, keys=ledger_jobs.find_job_keys(conn, job), rq_jobs=rq_jobs, holders=holders)


def delete_job(conn: redis.Redis, found: JobDeletion, *, again: bool = True,
               seen: frozenset[str] = frozenset()) -> None:
    """Remove what find_job found: RQ jobs from the queue and every registry, then the job's keys and name.
    An RQ job can move between places after the look (an engine takes a queued batch): each registry
    loses every entry of any id found anywhere (`seen`: the ids of an earlier pass, whose hashes are gone)."""
    ours = seen | {i for ids in found.rq_jobs.values() for i in ids}
    with conn.pipeline() as pipe:
        for place, holder in _rq_places(conn).items():
            mine = set(found.rq_jobs.get(place, []))
            if mine and place == "queued":
                for rq_id in mine:
                    holder.remove(rq_id, pipeline=pipe)
            elif place != "queued" and ours:  # the started registry holds "job:execution" entries
                if entries := [e for e in conn.zrange(holder.key, 0, -1) if holder.parse_job_id(e.decode()) in ours]:
                    pipe.zrem(holder.key, *entries)
        for rq_job in fetch_rq_jobs(conn, sorted({i for ids in found.rq_jobs.values() for i in ids})):
            if rq_job is not None:
                delete_rq_job(pipe, rq_job, remove_from_queue=False)
        if again or found.keys:  # the second pass leaves the name to a job created meanwhile
            ledger_jobs.stage_forget_job(pipe, found.job, found.keys)
        pipe.execute()
    if again:  # a batch RQ queued again or a worker wrote meanwhile would be orphaned: one more pass
        late = find_job(conn, found.job)
        delete_job(conn, late, again=False, seen=ours)
