"""The monitor's one record per job (JobProgress) that every view renders: `--json` and the progress
file as it is, the terminal (view.py), the web page (webapp.py), Prometheus (exporter.py). One path
fills it, Monitor.refresh(): one read of Redis, a throughput sample (rates.py), the ETA (eta.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import redis

from genq.core import decodebound
from genq.core.decodebound import Verdict, bottlenecks, fleet_gpu_note, slot_utilization
from genq.core.ledger import fleet
from genq.core.ledger.figures import FINISHED_STATUSES, JobSnapshot, JobStatus, WorkerView, read_job, shown_state
from genq.core.queueing import list_jobs
from genq.core.records import GpuSample, JobConfig
from genq.core.redisconn import RedisNote, redis_note_of
from genq.core.words import plural
from genq.monitor.eta import Estimate, LengthData, Speed, estimate
from genq.monitor.rates import RateTracker, once_speed
from genq.monitor.rqqueue import QueueMirror
from genq.ops.control import describe_block

JSON_ONLY = ("eta_s", "eta_low_s", "eta_high_s")  # the ETA in unrounded seconds: --json only
ETA_STATES = ("warming up", "estimating", "steady", "stalled", "paused", "done")
WORKER_STATES = ("starting", "busy", "idle", "paused", "draining", "server_down", "stopped", "silent", "lost")
# A worker's row without figures of now ("gone": lost once its job is done; "silent": its beats stopped).
DOWN = ("lost", "gone", "stopped", "silent")
# Fields of JobSnapshot that JobProgress carries as they are.
SAME = ("job", "status", "total", "completed", "failed", "in_flight", "queued", "held", "batches_total",
        "batches_done", "other_batches", "rq_queued", "shards", "shard_records")


class WorkerReport(msgspec.Struct):
    name: str
    state: str  # WORKER_STATES, or "gone": lost while its job is done, or forgotten (genq workers --prune)
    host: str | None = None
    in_flight: int = 0  # requests in flight (all jobs)
    concurrency_target: int = 0
    concurrency_limit: int | None = None
    server_capacity: int | None = None
    server_running: float | None = None
    server_waiting: float | None = None
    slot_utilization: float | None = None  # server_running / server_capacity
    kv_cache_usage: float | None = None
    tok_per_s: float = 0.0
    req_per_s: float = 0.0
    errors: int = 0
    job_in_flight: int = 0  # this job's requests on this worker
    job_completed: int = 0
    job_failed: int = 0
    job_output_tokens: int = 0
    gpu: GpuSample | None = None
    gpu_note: str | None = None
    bottlenecks: list[str] = []  # for people: with the numbers
    bottleneck_codes: list[str] = []  # the same, as fixed codes (genq.core.decodebound.CODES)
    heartbeat_age_s: float | None = None
    bound: Verdict | None = None  # its decode bound, the share reached, what caps its batch


class JobProgress(msgspec.Struct):
    job: str
    status: JobStatus  # writing = every prompt finished, shards still being written
    updated_at: float
    total: int
    completed: int
    failed: int
    in_flight: int
    queued: int  # not started: in the queue, held unsent by a worker, or in a batch elsewhere
    held: int  # of those, in batches workers hold
    percent: float  # finished (done or failed) of total
    percent_completed: float  # with a result
    percent_failed: float  # dead-lettered
    rate_per_sec: float | None  # prompts finished per second, recently (over the whole run once done)
    output_tokens_per_sec: float | None
    eta_hours: float | None
    eta_low_hours: float | None
    eta_high_hours: float | None
    eta_state: str  # ETA_STATES
    eta_note: str
    eta_s: float | None
    eta_low_s: float | None
    eta_high_s: float | None
    elapsed_hours: float
    elapsed_s: float  # from the first request sent (or creation) to now, or to the last result once done
    total_input_tokens: int
    total_output_tokens: int
    avg_output_tokens: float | None  # finished completions only: biased short while running
    expected_output_tokens: float | None  # fitted mean length, running ones included
    remaining_output_tokens: float | None
    batches_total: int
    batches_done: int
    queued_batches: int  # this job's batches in RQ's queue
    held_batches: int  # held by live workers
    other_batches: int  # neither written, held nor queued: retrying, failed in RQ, or orphaned
    rq_queued: int  # RQ's count of its `genq` queue, every job's batches (what `rq info` shows)
    shards: int
    shard_records: int
    s3_uploaded: int  # shards written, wherever the output is
    s3_bytes: int
    workers: int  # live workers on this job (none once it is done or partial)
    workers_lost: int
    rate_source: str
    gpu_note: str | None
    tail: str | None  # nothing left to start and its last requests hold few of the fleet's slots
    worker_details: list[WorkerReport]
    blocked: str | None = None  # why the job is blocked (docs/settings.md): the server's message and the counts
    blocked_reason: str | None = None  # "preflight" | "brake"
    priority: int = 0  # docs/scheduling.md
    weight: float = 1.0
    share: float = 0.0  # of the fleet's requests in flight now
    bound_summary: str | None = None  # its GPUs against their decode bound over the job so far


@dataclass
class JobReport:
    snapshot: JobSnapshot
    estimate: Estimate
    progress: JobProgress
    speed: Speed | None = None


class JobNotFound(LookupError):
    pass


class Monitor:
    """Keeps throughput samples per job between refreshes; thread-safe; `on_refresh` gets each refresh's reports."""

    def __init__(self, conn: redis.Redis, job: str | None = None, *, window_s: float = 120.0, once: bool = False,
                 on_refresh: Callable[[list[JobReport]], None] | None = None) -> None:
        self.conn, self.job, self.window_s, self.once, self.on_refresh = conn, job, window_s, once, on_refresh
        self.trackers: dict[tuple[str, str], RateTracker] = {}
        self.lock = threading.Lock()
        self.last: list[JobReport] = []
        self.last_at = 0.0  # time.monotonic() of the last refresh
        self.queue = QueueMirror()  # RQ's queue by genq job, read at its ends between refreshes
        self.fleet: list[WorkerReport] = []  # every worker in genq:workers, whatever job it works on
        self.redis_note: RedisNote | None = None  # Redis refusing writes, or evicting (genq.core.redisconn)

    @property
    def single(self) -> bool:
        """Whether output is one object (one job asked for or present) rather than keyed by job."""
        return self.job is not None or len(self.last) == 1

    def current(self, max_age: float) -> list[JobReport]:
        """The last reports while younger than max_age seconds, else fresh ones."""
        with self.lock:
            if self.last_at and time.monotonic() - self.last_at < max_age:
                return self.last
        return self.refresh()

    def refresh(self) -> list[JobReport]:
        with self.lock:
            self.redis_note = redis_note_of(self.conn)
            statuses = fleet.statuses(self.conn)
            self.queue.refresh(self.conn)
            now = time.time()  # the refresh's one time: every snapshot's, the fleet's, each worker's state
            judged = decodebound.judge({n: s for n, s in statuses.items() if shown_state(s, now) not in DOWN})
            reports, trackers, self.trackers = [], self.trackers, {}  # only jobs (lives) still there keep theirs
            for name in [self.job] if self.job is not None else list_jobs(self.conn):
                snap = read_job(self.conn, name, statuses, queued=self.queue.by_job.get(name, 0),
                                rq_queued=self.queue.total, at=now)
                if snap is None and self.job is not None:
                    raise JobNotFound(f"no job named {name!r} in this Redis (genq jobs lists them)")
                if snap is not None:
                    reports.append(self._report(snap, judged, trackers))
            self.fleet = [worker_report(WorkerView(name, status, at=now), now, bound=judged.get(name))
                          for name, status in sorted(statuses.items())]
            self.last, self.last_at = reports, time.monotonic()
            if self.on_refresh is not None:
                self.on_refresh(reports)
            return reports

    def _report(self, snap: JobSnapshot, judged: dict[str, Verdict], trackers: dict[Any, RateTracker]) -> JobReport:
        if self.once:
            speed, prompts_rate = once_speed(snap)
        else:
            # Samples of one life: a job deleted and enqueued again under its name is another job.
            life = (snap.job, snap.config.incarnation if snap.config else "")
            tracker = self.trackers[life] = trackers.get(life) or RateTracker(self.window_s)
            tracker.observe(snap)
            speed, prompts_rate = tracker.speed(), tracker.prompts_per_s()
        workers = [w for w in snap.workers if works_on(w, snap.config)]
        # Draining workers finish what they hold and take nothing more: alone, they leave the rest waiting.
        stranded = snap.queued > snap.held and all(w.state == "draining" for w in workers)
        est = estimate(
            total=snap.total, completed=snap.completed, failed=snap.failed,
            lengths=LengthData(snap.hist, snap.running_tokens, snap.config.max_tokens if snap.config else None),
            speed=speed, workers=0 if stranded else len(workers), paused=snap.paused and not snap.is_done,
            unsent=sum(w.inflight.queued for w in workers if w.inflight is not None))
        if snap.is_done:
            est.state = "done"
        return JobReport(snap, est, build_progress(snap, est, speed, prompts_rate, judged), speed)


def works_on(w: WorkerView, config: JobConfig | None) -> bool:
    """A beating worker holding the job's prompts, or an idle one whose server may run them (it takes the next
    batches; workers route by model); not paused or down."""
    s = w.live_status
    if s is None or s.state in ("paused", "server_down"):
        return False
    holds = w.inflight is not None and (w.inflight.tokens or w.inflight.queued or w.held_unfinished)
    return bool(holds) or (s.state in ("idle", "busy", "starting") and (config is None or config.served_by(s.model)))


def tail_note(snap: JobSnapshot) -> str | None:
    """Set while nothing of the job is left to start and its running requests fill at most half the slots."""
    if snap.status != "running" or snap.queued or snap.batches_queued or not snap.in_flight:
        return None
    live = [w.status for w in snap.serving if w.status is not None]  # another model's slots are none of its
    slots = sum(s.server_capacity or s.concurrency_target for s in live)
    if not slots or snap.in_flight * 2 > slots:
        return None
    busy = sum(1 for w in snap.serving if w.running_tokens)
    return (f"tail: nothing left to start; the last {plural(snap.in_flight, 'request')} run on {busy} of "
            f"{plural(len(live), 'worker')} ({slots - snap.in_flight:,} of {slots:,} slots idle). Throughput "
            f"falls as they finish: the end of the job, not a fault")


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _hours(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds / 3600, 4)


def build_progress(snap: JobSnapshot, est: Estimate, speed: Speed | None, prompts_rate: float | None,
                   judged: dict[str, Verdict]) -> JobProgress:
    # From the first request sent, or creation once a worker works on the job, to now or the last result.
    started = snap.first_at or (snap.created_at if snap.in_flight or snap.batches_held else None)
    end = snap.last_at if snap.is_done and snap.last_at else snap.at
    elapsed = max(0.0, end - (started or snap.at))
    statuses = [w.status for w in snap.workers if w.status is not None]
    tok_s = None if speed is None else speed.tokens_per_s
    if snap.paused and not snap.is_done and not snap.running_tokens:  # other jobs' requests may run on
        prompts_rate, tok_s = 0.0, 0.0  # paused and drained: nothing finishes now (a window's rate is stale)
    if snap.is_done:  # the whole run's averages, whoever looks: a window would read the idle tail
        prompts_rate = snap.completed / elapsed if elapsed > 0 else None
        tok_s = snap.out_tokens / elapsed if elapsed > 0 else None
    tail = tail_note(snap)
    pct: dict[str, Any] = {f"percent{k}": round(100.0 * n / snap.total, 2) if snap.total else 0.0 for k, n in (
        ("", snap.completed + snap.failed), ("_completed", snap.completed), ("_failed", snap.failed))}
    return JobProgress(
        **{f: getattr(snap, f) for f in SAME}, **pct, updated_at=round(snap.at, 3),
        rate_per_sec=_round(prompts_rate, 3), output_tokens_per_sec=_round(tok_s, 1),
        eta_hours=_hours(est.eta_s), eta_low_hours=_hours(est.eta_low_s), eta_high_hours=_hours(est.eta_high_s),
        eta_state=est.state, eta_note=est.note, eta_s=est.eta_s, eta_low_s=est.eta_low_s, eta_high_s=est.eta_high_s,
        elapsed_hours=round(elapsed / 3600, 4), elapsed_s=round(elapsed, 3),
        total_input_tokens=snap.in_tokens, total_output_tokens=snap.out_tokens,
        avg_output_tokens=round(snap.out_tokens / snap.completed, 1) if snap.completed else None,
        expected_output_tokens=_round(est.expected_output_tokens, 1),
        remaining_output_tokens=None if est.remaining_tokens is None else round(est.remaining_tokens),
        queued_batches=snap.batches_queued, held_batches=snap.batches_held, s3_uploaded=snap.shards,
        s3_bytes=snap.shard_bytes, workers=0 if snap.status in FINISHED_STATUSES else
        sum(1 for w in snap.live if w.inflight is not None),  # in-flight records outlive a done job by seconds
        workers_lost=0 if snap.is_done else sum(1 for w in snap.workers if w.state == "lost"),
        rate_source="" if speed is None else speed.source, gpu_note=fleet_gpu_note(statuses), tail=tail,
        worker_details=[worker_report(w, snap.at, snap.is_done, in_tail=tail is not None, job=snap.job,
                                      bound=judged.get(w.name)) for w in snap.workers],
        bound_summary=decodebound.job_line(statuses, snap.job),
        blocked=None if snap.blocked is None else describe_block(snap.job, snap.blocked),
        blocked_reason=None if snap.blocked is None else snap.blocked.reason,
        priority=snap.schedule.priority, weight=snap.schedule.weight, share=round(snap.share, 3))


def worker_report(w: WorkerView, now: float, job_done: bool = False, *, in_tail: bool = False,
                  job: str | None = None, bound: Verdict | None = None) -> WorkerReport:
    """A worker's row, with its figures for `job` when given; a stopped, lost or gone one without those of now."""
    s = w.status
    # Gone: lost while its job is done, or forgotten (genq workers --prune); else as views show it.
    state = "gone" if s is None and (job_done or w.forgotten) else shown_state(s, now)
    # In the job's tail an idle worker is expected (the tail note says so), not a bottleneck.
    found = [] if state == "gone" else [b for b in bottlenecks(s) if not (in_tail and b[0] == "no_prompts")]
    # A done job has nothing in flight: a worker's InFlight record can be a beat older than its last result.
    row: dict[str, Any] = dict(
        name=w.name, state=state,
        job_in_flight=0 if job_done else len(w.running_tokens), job_completed=w.counters.done,
        job_failed=w.counters.failed, job_output_tokens=w.counters.out_tok, bound=bound,
        bottlenecks=[text for _, text in found], bottleneck_codes=[code for code, _ in found])
    if s is not None:
        row.update(host=s.host, concurrency_target=s.concurrency_target, concurrency_limit=s.concurrency_limit,
                   server_capacity=s.server_capacity, gpu_note=s.gpu_note,
                   errors=s.errors if job is None else s.job_errors.get(job, 0),
                   heartbeat_age_s=round(max(0.0, now - s.heartbeat_at), 1))
    if s is not None and state not in DOWN:  # a stopped or silent one's last rates, slots and GPU are not of now
        row.update(in_flight=s.in_flight, server_running=s.server_running, server_waiting=s.server_waiting,
                   slot_utilization=_round(slot_utilization(s), 3), kv_cache_usage=s.server_token_usage,
                   tok_per_s=s.tok_per_s, req_per_s=s.req_per_s, gpu=s.gpu_sample)
    return WorkerReport(**row)


def document(reports: list[JobReport], single: bool, *, for_json: bool) -> Any:
    """One job: its record; several: keyed by job name. The ETA in unrounded seconds only for --json."""
    def one(p: JobProgress) -> Any:
        return p if for_json else {k: v for k, v in msgspec.to_builtins(p).items() if k not in JSON_ONLY}

    if single and len(reports) == 1:
        return one(reports[0].progress)
    return {r.progress.job: one(r.progress) for r in reports}


encode = msgspec.json.Encoder().encode
