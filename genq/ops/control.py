"""The fleet and the jobs as operators see and steer them (workers read their Control and the job's settings every
second). A settings change is written to OUTPUT/JOB/job.json, their durable truth, before Redis."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import redis

from genq.core import order
from genq.core.decodebound import NO_HEARTBEAT
from genq.core.ledger import fleet as ledger_fleet
from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger import leasing
from genq.core.ledger.figures import JobStatus, beating, job_status, shown_state
from genq.core.order import order_queue
from genq.core.queueing import carried, delete_rq_job, fetch_rq_jobs, list_jobs, load_config, rq_queue, suspend_loops
from genq.core.records import Control, JobBlock, JobConfig, JobRecord, JobSchedule, SettingsChange, WorkerStatus
from genq.core.redisconn import redis_note_of
from genq.output import truth
from genq.producer.rows import check_params

log = logging.getLogger("genq.control")
LOST = "lost"  # in the fleet's list, but its status key expired: the process died without saying so
# A lost worker's fields, read through its status otherwise.
_LOST = {"host": None, "gpu": None, "server": None, "pid": None, "in_flight": 0, "queued": 0, "tok_per_s": 0.0,
         "req_per_s": 0.0, "done": 0, "errors": 0, "model": None, "server_capacity": None, "concurrency_limit": None,
         "concurrency_target": 0}
# `genq workers --json`; "cap" is concurrency_limit's first name, documented in docs/fleet.md.
JSON_FIELDS = ("name", "state", "host", "gpu", "server", "pid", "batches", "in_flight", "target", "concurrency_limit",
               "server_capacity", "cap", "queued", "tok_per_s", "req_per_s", "done", "errors", "heartbeat_age_s",
               "note", "model")


class Refused(Exception):
    """What the operator asked cannot be done: the message says why and what to do (the CLI: one line, exit 1)."""


def jobs_named(conn: redis.Redis, job: str | None) -> list[str]:
    """The jobs a command covers: the named one, which must exist, or (None) all of them."""
    known = list_jobs(conn)
    if job is None:
        return known
    if job not in known:
        raise Refused(f"no job named {job!r} (known jobs: {', '.join(known) or 'none'})")
    return [job]


@dataclass(frozen=True)
class WorkerRow:
    """One line of `genq workers`: the worker's own record, None once its heartbeat expired (lost)."""

    name: str
    status: WorkerStatus | None
    now: float

    def __getattr__(self, field: str) -> Any:
        if field not in _LOST:
            raise AttributeError(field)
        return _LOST[field] if self.status is None else getattr(self.status, field)

    state = property(lambda self: shown_state(self.status, self.now))
    live = property(lambda self: self.state not in ("stopped", LOST))  # may take instructions; kept by --prune
    beating = property(lambda self: beating(self.status, self.now))  # its figures are of now
    batches = property(lambda self: [] if self.status is None else [str(b) for b in self.status.batches])
    target = property(lambda self: self.concurrency_target)
    cap = property(lambda self: self.concurrency_limit)

    @property
    def heartbeat_age_s(self) -> float | None:
        return None if self.status is None else round(max(0.0, self.now - self.status.heartbeat_at), 1)

    @property
    def note(self) -> str | None:
        if (s := self.status) is None:
            return f"{NO_HEARTBEAT}; its batches are queued again"
        return s.note or (s.gpu_note if s.state == "server_down" else None)

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in JSON_FIELDS}


class JobRow(msgspec.Struct, omit_defaults=False):
    """One line of `genq jobs`; share is the job's part of the fleet's running requests (0..1)."""

    name: str
    state: JobStatus
    paused: bool
    total: int
    done: int
    failed: int
    remaining: int
    batches: int
    batches_done: int
    workers: list[str] = []  # beating workers running this job's requests right now
    output: str | None = None
    blocked: JobBlock | None = None  # why its settings stopped it (docs/settings.md)
    settings_version: int = 1
    priority: int = 0  # its JobSchedule (docs/scheduling.md)
    weight: float = 1.0
    running: int = 0
    share: float = 0.0


def fleet(conn: redis.Redis) -> list[WorkerRow]:
    """Every worker that ever heartbeated, by host then GPU."""
    now = time.time()
    rows = [WorkerRow(name, status, now) for name, status in ledger_fleet.statuses(conn).items()]
    return sorted(rows, key=lambda r: (r.host is None, r.host or "", int(r.gpu) if (r.gpu or "").isdigit() else -1,
                                       r.name))


def select(rows: Iterable[WorkerRow], *, workers: Iterable[str] = (), host: str | None = None,
           everyone: bool = False, gone_too: bool = False) -> list[WorkerRow]:
    """The live workers an operator named (gone_too: the stopped or lost ones named too); Refused says what
    exists when a name matches none."""
    rows = list(rows)
    if everyone or host is not None:
        if not (chosen := [r for r in rows if r.live and (everyone or r.host == host)]) and host is not None:
            hosts = sorted({r.host for r in rows if r.live and r.host})
            raise Refused(f"no live worker on host {host!r}; live hosts: {', '.join(hosts) or 'none'}")
        return chosen
    by_name, workers = {r.name: r for r in rows}, dict.fromkeys(workers)  # a name given twice is one worker
    for name in workers:
        if name not in by_name:
            raise Refused(f"no worker named {name!r}; known: {', '.join(sorted(by_name)) or 'none'}")
        if not by_name[name].live and not gone_too:
            raise Refused(f"worker {name!r} is {by_name[name].state}; it cannot take instructions")
    return [by_name[name] for name in workers]


def update_control(conn: redis.Redis, name: str, **change: Any) -> Control:
    """Set fields (drain, concurrency: None or 0 is auto) of a worker's Control record, keeping the others."""
    def apply(control: Control) -> None:
        for field, value in change.items():
            setattr(control, field, (value or None) if field == "concurrency" else value)

    control = ledger_fleet.change_control(conn, name, apply)
    ledger_fleet.tell_idle_workers(conn)  # idle workers read their control every 20 s: now, instead
    return control


def pause(conn: redis.Redis, job: str | None = None) -> None:
    """Stop dispatching new requests (all jobs, or one); in-flight requests finish."""
    if job is None:
        ledger_jobs.pause(conn)
        suspend_loops(conn)  # as `rq suspend`: no engine (TAKE) and no stock RQ worker takes a new batch
    else:  # its batches leave RQ's queue and its workers park theirs: their slots go to other jobs
        schedule = ledger_jobs.change_schedule(conn, job, numbered, paused=True)
        leasing.unqueue(conn, job)
        keep_paused(conn, job, True, schedule)
    ledger_fleet.tell_idle_workers(conn)


def numbered(schedule: JobSchedule) -> JobSchedule:
    """A pause or resume of the job is a schedule change: the next version (docs/recovery.md)."""
    return msgspec.structs.replace(schedule, version=schedule.version + 1)


def keep_paused(conn: redis.Redis, job: str, paused: bool, schedule: JobSchedule) -> None:
    """job.json says whether the job is paused as of `schedule`, so a job rebuilt from its output comes back so;
    an older version never over a newer one. Written after Redis: a pause must work while the output is
    unreachable (said on stderr; the next catch-up writes it, settings_from_output)."""
    if (config := load_config(conn, job)) is None:
        return
    store = truth.open_store(config.output, config.s3_endpoint_url)
    try:
        truth.update_job(store, job, lambda record: msgspec.structs.replace(record, paused=paused, schedule=schedule)
                         if record is not None and record.config.incarnation == config.incarnation
                         and (record.schedule or schedule).version <= schedule.version else None)
    except Exception as exc:  # OSError, botocore's errors: the output unreachable from here
        log.warning("job %s: %s in Redis, but %s could not be written (%s: %s): a job rebuilt from its output "
                    "would not be", job, "paused" if paused else "resumed", truth.job_uri(store, job),
                    type(exc).__name__, exc)


def resume(conn: redis.Redis, job: str | None = None) -> int:
    """Undo a pause; with a job, also lift its block and queue its parked batches: how many."""
    queued = 0
    if job is None:
        with conn.pipeline() as pipe:  # one transaction: a Redis refusing writes takes neither, nothing changes
            ledger_jobs.resume(pipe)
            suspend_loops(pipe, suspended=False)
            pipe.execute()
    else:
        queued, schedule = leasing.resume_job(conn, job, numbered)
        if queued:
            order_queue(conn)  # queued at the front: in priority order again (genq.core.order)
        keep_paused(conn, job, False, schedule)
    ledger_fleet.tell_idle_workers(conn)
    return queued


def job_rows(conn: redis.Redis, names: Iterable[str] | None = None) -> list[JobRow]:
    """Totals per job from the counters of record (genq.core.ledger.jobs.counts)."""
    names = list_jobs(conn) if names is None else list(names)
    paused_all, fleet_names, at = ledger_jobs.paused_all(conn), ledger_fleet.worker_names(conn), time.time()
    statuses = ledger_fleet.statuses(conn, fleet_names)
    rows = []
    for job, now in zip(names, ledger_jobs.jobs_now(conn, names)):
        t, config = ledger_jobs.counts(conn, job, fleet_names), now.config
        t.inflight = {w: r for w, r in t.inflight.items() if beating(statuses[w], at)}  # a silent one's: not of now
        paused, finished = paused_all or now.paused, t.completed + t.dead
        state = job_status(total=t.total, finished=finished, batches=t.batches, batches_done=t.done, paused=paused,
                           started=bool(t.inflight) or finished > 0, failed=t.dead, blocked=now.blocked is not None)
        rows.append(JobRow(
            name=job, state=state, paused=paused, total=t.total, done=t.completed, failed=t.dead,
            remaining=max(0, t.total - finished), batches=t.batches, batches_done=t.done,
            workers=list(t.inflight), output=config.output if config else None, blocked=now.blocked,
            settings_version=config.settings_version if config else 1, priority=now.schedule.priority,
            weight=now.schedule.weight, running=sum(len(r.tokens) for r in t.inflight.values())))
    # Every job's requests running, as the monitor's.
    if running := sum(s.in_flight for s in statuses.values() if s is not None and beating(s, at)):
        for r in rows:
            r.share = min(1.0, r.running / running)
    return rows


class JobDeletion(msgspec.Struct):  # what `genq jobs delete` found (and removes) of one job
    job: str
    keys: list[str]  # everything under genq:job:JOB:
    rq_jobs: dict[str, list[str]]  # where its RQ jobs are (queued, started, failed...) -> RQ job ids
    holders: dict[str, str]  # live workers holding its batches -> their shown state (silent: a drain cannot help)


def _rq_places(conn: redis.Redis) -> dict[str, Any]:
    q = rq_queue(conn)
    return {"queued": q} | {p: getattr(q, f"{p}_job_registry")
                            for p in ("started", "finished", "failed", "deferred", "scheduled", "canceled")}


def find_job(conn: redis.Redis, job: str) -> JobDeletion:
    rq_jobs: dict[str, list[str]] = {}
    for place, holder in _rq_places(conn).items():
        # cleanup=False: looking must not make RQ move jobs between registries.
        ids = holder.get_job_ids() if place == "queued" else holder.get_job_ids(cleanup=False)
        if mine := [j.id for j in fetch_rq_jobs(conn, ids) if j is not None and (c := carried(j)) and c[0] == job]:
            rq_jobs[place] = mine
    holders = {r.name: r.state for r in fleet(conn) if r.live and any(b.split("/", 1)[0] == job for b in r.batches)}
    return JobDeletion(job=job, keys=ledger_jobs.find_job_keys(conn, job), rq_jobs=rq_jobs, holders=holders)


def delete_job(conn: redis.Redis, found: JobDeletion, *, again: bool = True,
               seen: frozenset[str] = frozenset()) -> None:
    """Remove what find_job found: RQ jobs from the queue and every registry (each registry loses any id found
    anywhere, or in an earlier pass: `seen`; they move), then the job's keys and name."""
    found_ids = {i for ids in found.rq_jobs.values() for i in ids}
    ours = seen | found_ids
    with conn.pipeline() as pipe:
        for place, holder in _rq_places(conn).items():
            if place == "queued":
                for rq_id in found.rq_jobs.get(place, []):
                    holder.remove(rq_id, pipeline=pipe)
            # the started registry holds "job:execution" entries, the others plain job ids
            elif ours and (entries := [e for e in conn.zrange(holder.key, 0, -1)
                                       if holder.parse_job_id(e.decode()) in ours]):
                pipe.zrem(holder.key, *entries)
        for rq_job in fetch_rq_jobs(conn, sorted(found_ids)):
            if rq_job is not None:
                delete_rq_job(pipe, rq_job, remove_from_queue=False)
        if again or found.keys:  # the second pass leaves the name to a job created meanwhile
            ledger_jobs.stage_forget_job(pipe, found.job, found.keys)
        pipe.execute()
    if again:  # a batch RQ queued again or a worker wrote meanwhile would be orphaned: one more pass
        delete_job(conn, find_job(conn, found.job), again=False, seen=ours)


# What `genq jobs set` may change: what is sent with each request. Not endpoint (rows were fitted to
# it at enqueue), output, batch size or compression (written batches and shards follow them).
SETTABLE = ("model", "max_tokens", "temperature", "top_p", "extra_body", "max_attempts", "brake")


def set_settings(conn: redis.Redis, job: str, changes: dict[str, Any],
                 note: str | None = None) -> tuple[JobConfig, dict[str, Any]]:
    """Store those of `changes` the job has not already as its next settings version (none if nothing
    differs): (its config, what changed)."""
    if unknown := sorted(set(changes) - set(SETTABLE)):
        raise Refused(f"cannot set {', '.join(unknown)}; settable: {', '.join(SETTABLE)}")
    writable(conn)
    differing: dict[str, Any] = {}

    def change(config: JobConfig | None) -> JobConfig:
        if config is None:
            raise Refused(f"no job named {job!r} (or it has no stored settings)")
        differing.clear()  # WATCH may run this again
        differing.update({k: v for k, v in changes.items() if getattr(config, k) != v})
        if not differing:
            return config  # it has them all already: nothing stored
        if "extra_body" in differing:  # checked for the job's endpoint, as at enqueue
            check_params(differing["extra_body"], "--extra-body", config.endpoint)
        version = config.settings_version + 1
        entry = SettingsChange(version=version, at=time.time(), changed=dict(differing),
                               previous={k: getattr(config, k) for k in differing}, note=note)
        new = msgspec.structs.replace(config, **differing, settings_version=version,
                                      settings_history=[*config.settings_history, entry])
        write_settings(conn, new)  # the output first: Redis may lose the change, the output keeps it
        return new

    return ledger_jobs.change_config(conn, job, change), differing


def writable(conn: redis.Redis) -> None:
    """Refused when Redis refuses writes: job.json, written first and taken up later, must not get a change
    said to have failed."""
    if (refusing := redis_note_of(conn)) is not None and refusing.reason != "evicting_policy":
        raise Refused(f"{refusing.text}. Nothing was changed (job.json neither); run this again once Redis "
                      "takes writes")


def set_schedule(conn: redis.Redis, job: str, priority: int | None, weight: float | None) -> JobSchedule:
    """The job's priority and/or weight changed, in job.json before Redis as its settings are."""
    writable(conn)
    if (config := load_config(conn, job)) is None:
        raise Refused(f"no job named {job!r} (or it has no stored settings)")
    # The pause is read again when job.json is written: it may have changed under WATCH.
    return order.set_schedule(conn, job, priority, weight, keep=lambda new: write_settings(
        conn, config, new, pause_of(ledger_jobs.jobs_now(conn, [job], together=True)[0])))


def pause_of(now: ledger_jobs.JobNow) -> bool | None:
    """The job's pause as job.json keeps it: `pause --job`'s, not a block's (None: job.json's own kept)."""
    return None if now.blocked else now.paused


def write_settings(conn: redis.Redis, config: JobConfig, schedule: JobSchedule | None = None,
                   paused: bool | None = None) -> None:
    """OUTPUT/JOB/job.json with `config`, or only with `schedule` and the pause of its version (the rest kept),
    or Refused."""
    store = truth.open_store(config.output, config.s3_endpoint_url)

    def change(record: JobRecord | None) -> JobRecord:
        if record is None or record.config.incarnation != config.incarnation:  # an output without job.json
            record = JobRecord(config=config, reserved=ledger_jobs.last_batch_number(conn, config.name))
        if schedule is not None:  # never an older one over a newer one: writers race (truth.update_job)
            return record if record.schedule and record.schedule.version > schedule.version else \
                msgspec.structs.replace(record, schedule=schedule, paused=record.paused if paused is None else paused)
        return msgspec.structs.replace(record, config=truth.newer_config(config, record.config))

    try:
        truth.update_job(store, config.name, change)
    except redis.RedisError:
        raise
    except Exception as exc:  # OSError, botocore's errors: the output is unreachable from here
        raise Refused(f"cannot write {truth.job_uri(store, config.name)} ({type(exc).__name__}: {exc}): the "
                      "job's settings are kept there first, so nothing was changed; run this where the "
                      "output is reachable") from None


def keep_pin(config: JobConfig) -> None:
    """job.json's `--model auto` replaced by the model a worker pinned in Redis (genq.worker.gate)."""
    def change(record: JobRecord | None) -> JobRecord | None:
        if (record is None or record.config.model != "auto" or record.config.incarnation != config.incarnation
                or config.model == "auto"):
            return None
        return msgspec.structs.replace(record, config=msgspec.structs.replace(record.config, model=config.model))

    truth.update_job(truth.open_store(config.output, config.s3_endpoint_url), config.name, change)


def settings_from_output(conn: redis.Redis, config: JobConfig, record: JobRecord | None) -> None:
    """Redis's and job.json's settings and schedule brought to the latest of the two (same life of the job): a
    restored or lagging Redis may have lost a `jobs set`."""
    if record is None or record.config.incarnation != config.incarnation:
        return
    now = ledger_jobs.jobs_now(conn, [config.name], together=True)[0]
    stored, kept = now.schedule, record.schedule
    if stored.version > (kept.version if kept else -1) and (kept or stored != JobSchedule()):
        write_settings(conn, config, stored, pause_of(now))  # and its pause: `pause --job` could not write it
    elif kept and kept.version > stored.version:  # and the pause or resume of that version (keep_paused)
        def newest(now: JobSchedule) -> JobSchedule:
            return kept if now.version < kept.version else now

        if now.paused and not record.paused and now.blocked is None:
            leasing.resume_job(conn, config.name, newest)
        else:  # a blocked job stays so
            ledger_jobs.change_schedule(conn, config.name, newest, record.paused or (None if now.blocked else False))
            if record.paused and not now.paused:
                leasing.unqueue(conn, config.name)
        order_queue(conn)
    on_disk = record.config
    if on_disk.settings_version < config.settings_version:
        return write_settings(conn, config)
    if on_disk.settings_version == config.settings_version:
        return keep_pin(config) if on_disk.model == "auto" != config.model else None  # a pin not written yet

    def take(stored: JobConfig | None) -> JobConfig:
        if (stored is None or stored.incarnation != on_disk.incarnation
                or stored.settings_version >= on_disk.settings_version):
            raise Refused("Redis has the latest settings already (or lost the job meanwhile): nothing to store")
        return msgspec.structs.replace(stored, **{k: getattr(on_disk, k) for k in SETTABLE},
                                       settings_version=on_disk.settings_version,
                                       settings_history=on_disk.settings_history)

    with contextlib.suppress(Refused):
        ledger_jobs.change_config(conn, config.name, take)


def blocked_jobs(conn: redis.Redis) -> list[str]:
    names = list_jobs(conn)
    return sorted(job for job, now in zip(names, ledger_jobs.jobs_now(conn, names)) if now.blocked)


def describe_block(job: str, block: JobBlock) -> str:
    why = f"preflight by {block.worker}" if block.reason == "preflight" else (
        f"brake on {block.worker}: {block.failures} of its last {block.outcomes} requests failed the same way "
        f"across {block.prompts} prompts (settings version {block.settings_version}"
        f"{f', HTTP {block.status}' if block.status else ''})")
    return (f"job {job} is blocked ({why}): {block.message} -- its prompts stay queued; fix the settings "
            f"(genq jobs set {job} ...), then genq resume --job {job}")
