"""Read one job's state out of Redis in a few pipelined round trips.

Truth for totals: total = job_stats "total"; completed = sum of
the workers' "done" counters; failed = current dead letters (HLEN job_dlq);
tokens = sums of the workers' counters. Running requests and their token
counts come from the workers' InFlight records (TTL 5 s), worker health from
their WorkerStatus records (TTL 15 s): a worker in keys.WORKERS whose status
expired is "lost".

Batches: done = keys.job_done; held = named in a live worker's
WorkerStatus.batches while their record exists; queued = this job's RQ jobs in
RQ's queue (what `rq info` counts). Anything else (waiting for a retry, failed
in RQ, orphaned by a dead worker until RQ's cleanup) is "elsewhere", never
called queued. Shards: their count (HLEN keys.job_shards) and the running totals
of their records and bytes that the ledger's RELEASE keeps in keys.job_stats, so
a refresh reads no per-batch record of the job (its cost does not grow with the
job); the held batches' details are read only for batches live workers name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
import redis

from genq.core import ledger, scripts
from genq.core.ledger import fleet, letters
from genq.core.ledger.figures import held_progress, job_facts, live_held, worker_figures
from genq.core.records import InFlight, JobBlock, JobConfig, JobSchedule, WorkerStatus, unpack
from genq.core.state import JobStatus, job_status
from genq.monitor.rqqueue import QueueMirror


@dataclass
class WorkerCounters:
    """One worker's counters for one job (keys.worker_stats)."""

    done: int = 0
    failed: int = 0
    in_tok: int = 0
    out_tok: int = 0
    first_at: float | None = None
    last_at: float | None = None


@dataclass
class WorkerView:
    name: str
    status: WorkerStatus | None  # None: the status key expired (lost) or never written
    counters: WorkerCounters = field(default_factory=WorkerCounters)
    inflight: InFlight | None = None  # this job's running requests on this worker
    # Unfinished prompts of each batch of this job the worker holds, oldest first.
    held_unfinished: list[int] = field(default_factory=list)

    @property
    def live(self) -> bool:
        return self.status is not None and self.status.state != "stopped"

    @property
    def state(self) -> str:
        return "lost" if self.status is None else self.status.state

    @property
    def running_tokens(self) -> list[int]:
        return list(self.inflight.tokens) if self.inflight is not None else []

    @property
    def decoding(self) -> int:
        """This job's requests the server is decoding: in flight with a token made (a request
        without one waits in the server's queue or its prefill), at most its capacity."""
        n = sum(1 for t in self.running_tokens if t > 0)
        cap = self.status.server_capacity if self.status is not None else None
        return min(n, cap) if cap else n

    @property
    def live_status(self) -> WorkerStatus | None:
        """Its status while it runs (None when stopped or lost)."""
        return self.status if self.live else None

    @property
    def slots(self) -> int:
        """Requests this worker can decode at once: its in-flight target, at most its server's
        capacity (both in sequences), over the samples its requests in flight ask for."""
        s = self.live_status
        if s is None:
            return 0
        target = s.concurrency_target or s.in_flight
        slots = min(target, s.server_capacity) if s.server_capacity else target
        if s.sequences > s.in_flight > 0:  # requests of n samples: each takes n of the sequences
            slots = max(1, slots * s.in_flight // s.sequences)
        return slots


@dataclass
class JobSnapshot:
    job: str
    at: float
    config: JobConfig | None
    total: int
    created_at: float | None
    batches_total: int
    batches_done: int
    batches_held: int  # by live workers, not yet written
    completed: int
    failed: int
    in_tokens: int
    out_tokens: int
    hist: dict[int, int]
    workers: list[WorkerView]
    paused: bool  # this job or every job
    shards: int
    shard_bytes: int
    shard_records: int
    batches_queued: int = 0  # this job's batches in RQ's queue
    rq_queued: int = 0  # every batch in RQ's queue, all jobs (`rq info`)
    blocked: JobBlock | None = None  # why the job's settings stopped it (docs/settings.md)
    schedule: JobSchedule = field(default_factory=JobSchedule)  # priority and weight (docs/scheduling.md)
    fleet_running: int = 0  # requests in flight on the live workers, every job's

    @property
    def share(self) -> float:
        """This job's part of the fleet's requests in flight now (0 when nothing runs). Both counts
        as of the workers' last beats: in_flight's cap at what is left would count the requests
        finished since the beat in the fleet's and not in the job's (a job alone read < 1)."""
        return min(1.0, len(self.running_tokens) / self.fleet_running) if self.fleet_running else 0.0

    @property
    def running_tokens(self) -> list[int]:
        return [t for w in self.workers if w.live for t in w.running_tokens]

    @property
    def in_flight(self) -> int:
        # In-flight records live 5 s after a request ends: never more than what is left.
        return min(len(self.running_tokens), max(0, self.total - self.completed - self.failed))

    @property
    def held(self) -> int:
        """Prompts in batches live workers hold, not finished and not running (ready, parked while
        paused, or waiting for a retry): from the batches, not the worker's ready list, which a
        paused worker empties."""
        unsent = sum(max(0, sum(w.held_unfinished) - len(w.running_tokens)) for w in self.workers if w.live)
        return min(unsent, self.queued)

    @property
    def queued(self) -> int:
        """Prompts not started anywhere: in the RQ queue, held by a worker, or elsewhere."""
        return max(0, self.total - self.completed - self.failed - self.in_flight)

    @property
    def queued_batches(self) -> int:
        """This job's batches in RQ's queue."""
        return self.batches_queued

    @property
    def other_batches(self) -> int:
        """Batches neither written, held nor queued: retrying, failed in RQ, or orphaned by a lost worker."""
        return max(0, self.batches_total - self.batches_done - self.batches_held - self.batches_queued)

    @property
    def generated_tokens(self) -> int:
        """Output tokens produced so far, finished or not: the smooth quantity a rate is read from."""
        return self.out_tokens + sum(self.running_tokens)

    @property
    def decoding(self) -> int:
        return sum(w.decoding for w in self.workers if w.live)

    @property
    def slots(self) -> int:
        return sum(w.slots for w in self.workers if w.live)

    @property
    def first_at(self) -> float | None:
        firsts = [w.counters.first_at for w in self.workers if w.counters.first_at]
        return min(firsts) if firsts else None

    @property
    def last_at(self) -> float | None:
        lasts = [w.counters.last_at for w in self.workers if w.counters.last_at]
        return max(lasts) if lasts else None

    @property
    def is_done(self) -> bool:
        return self.total > 0 and self.completed + self.failed >= self.total

    @property
    def status(self) -> JobStatus:
        return job_status(total=self.total, finished=self.completed + self.failed, batches=self.batches_total,
                          batches_done=self.batches_done, paused=self.paused,
                          started=self.completed + self.failed > 0 or self.in_flight > 0, failed=self.failed,
                          blocked=self.blocked is not None)


def _int(value: bytes | None) -> int:
    return int(value) if value else 0


def _float(value: bytes | None) -> float | None:
    return float(value) if value else None


def read_workers(conn: redis.Redis) -> dict[str, WorkerStatus | None]:
    """Every worker that ever heartbeated, with its status (None when expired: lost)."""
    return fleet.statuses(conn)


@dataclass
class QueueCounts:
    total: int  # RQ's count of the genq queue
    by_job: dict[str, int]


def read_queue(conn: redis.Redis, mirror: QueueMirror | None = None) -> QueueCounts:
    """RQ's queue as `rq info` shows it, and how many of its batches belong to each genq job.

    `mirror`, kept by the caller between refreshes (the live monitor), makes a refresh read
    only what changed at the queue's ends (monitor/rqqueue.py); without one the whole queue is read.
    """
    if mirror is None:
        mirror = QueueMirror()
    mirror.refresh(conn)
    return QueueCounts(mirror.total, dict(mirror.by_job))


def read_job(conn: redis.Redis, job: str, workers: dict[str, WorkerStatus | None] | None = None,
             now: float | None = None, queue: QueueCounts | None = None) -> JobSnapshot | None:
    """The job's snapshot, or None when no such job exists."""
    if workers is None:
        workers = read_workers(conn)
    if queue is None:
        queue = read_queue(conn)
    facts = job_facts(conn, job)
    if facts is None:
        return None
    stats = facts.stats
    names = sorted(set(workers) | facts.workers)
    views: list[WorkerView] = []
    for name, (raw_stats, inflight) in zip(names, worker_figures(conn, job, names)):
        status = workers.get(name)
        # Shown for this job: it has counters here, or it is working on it, or it is alive.
        if name not in facts.workers and inflight is None and (status is None or status.state == "stopped"):
            continue
        counters = WorkerCounters(
            done=_int(raw_stats.get(b"done")), failed=_int(raw_stats.get(b"failed")),
            in_tok=_int(raw_stats.get(b"in_tok")), out_tok=_int(raw_stats.get(b"out_tok")),
            first_at=_float(raw_stats.get(b"first_at")), last_at=_float(raw_stats.get(b"last_at")),
        )
        views.append(WorkerView(name=name, status=status, counters=counters, inflight=inflight))

    config = facts.config
    held = _held_batches(conn, job, views, config.batch_size if config else 0)
    return JobSnapshot(
        job=job,
        at=now if now is not None else time.time(),
        config=config,
        total=_int(stats.get(b"total")),
        created_at=_float(stats.get(b"created_at")),
        batches_total=facts.batches,
        batches_done=facts.done,
        batches_held=held,
        batches_queued=queue.by_job.get(job, 0),
        rq_queued=queue.total,
        completed=sum(v.counters.done for v in views),
        failed=facts.dead,
        in_tokens=sum(v.counters.in_tok for v in views),
        out_tokens=sum(v.counters.out_tok for v in views),
        hist=facts.hist,
        workers=views,
        paused=facts.paused,
        shards=facts.shards,
        shard_bytes=_int(stats.get(scripts.SHARD_BYTES.encode())),
        shard_records=_int(stats.get(scripts.SHARD_RECORDS.encode())),
        blocked=facts.block,
        schedule=facts.schedule,
        fleet_running=sum(s.in_flight for s in workers.values() if s is not None and s.state != "stopped"),
    )


HELD_READ_LIMIT = 2_000  # held batches looked at per refresh: bounded by the fleet, never by the job


def _held_batches(conn: redis.Redis, job: str, views: list[WorkerView], batch_size: int) -> int:
    """Count the batches of this job that live workers hold, and fill each view's held_unfinished.

    WorkerStatus.batches names (job, batch); one of this job's counts while its
    record still exists (it is deleted when the shard is written). Unfinished = batch size minus results
    stored so far (a batch's own size is not stored apart from its prompts;
    the job's batch size is exact for all but the last batch of an enqueue).
    """
    asks = [(v, b.batch) for v in views if (s := v.live_status) is not None and v.inflight is not None
            for b in sorted(s.batches) if b.job == job][:HELD_READ_LIMIT]
    stored, leases = held_progress(conn, job, [bid for _, bid in asks])
    held = 0
    for (view, _), results in zip(asks, stored):
        if results is not None:
            held += 1
            view.held_unfinished.append(max(0, batch_size - results))
    return held + _leased_unnamed(conn, job, leases, {bid for _, bid in asks})


def _leased_unnamed(conn: redis.Redis, job: str, leases: dict[str, str], named: set[str]) -> int:
    """Batches a live engine has leased that no status record names yet (it publishes one a second):
    held all the same, not "elsewhere". A lease of an engine that stopped beating is not counted."""
    unnamed: list[tuple[str, str]] = []
    for bid, value in leases.items():
        holder = ledger.lease_holder(value)
        if holder and bid not in named and len(unnamed) < HELD_READ_LIMIT:
            unnamed.append((bid, holder))
    return live_held(conn, job, unnamed)


@dataclass
class DeadLetterSummary:
    total: int
    by_kind: dict[str, int]
    latest: list[dict]  # newest first: id, kind, message, worker, batch, at, attempts, status


DLQ_READ_LIMIT = 20_000  # letters read for the breakdown; beyond, by_kind covers the first ones scanned


def read_dead_letters(conn: redis.Redis, job: str, latest: int = 5) -> DeadLetterSummary:
    """The job's dead letters by kind, and the newest few (for the web page)."""
    from genq.core.records import DeadLetter

    total = letters.count(conn, job)
    by_kind: dict[str, int] = {}
    found: list[DeadLetter] = []
    for n, raw in enumerate(letters.scan_raw(conn, job, 1000)):
        if n >= DLQ_READ_LIMIT:
            break
        try:
            letter = unpack(raw, DeadLetter)
        except msgspec.DecodeError:
            continue
        by_kind[letter.kind] = by_kind.get(letter.kind, 0) + 1
        found.append(letter)
    found.sort(key=lambda d: d.at, reverse=True)
    rows = [dict(id=d.id, kind=d.kind, message=d.message[:300], worker=d.worker, batch=d.batch, at=d.at,
                 attempts=d.attempts, status=d.status) for d in found[:latest]]
    return DeadLetterSummary(total=total, by_kind=dict(sorted(by_kind.items())), latest=rows)
