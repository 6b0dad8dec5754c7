"""A job's figures as the monitor and `genq jobs` read them, in round trips that grow with the
fleet, never with the job. total: its stats; completed and tokens: its workers' counters; failed: its
dead letters; running: InFlight records; batches held: named by a beating worker or leased by its engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, get_args

import redis

from genq.core import keys, ledger, scripts
from genq.core.ledger import fleet, jobs
from genq.core.records import InFlight, JobBlock, JobConfig, JobSchedule, WorkerStatus, unpack
from genq.core.timings import BEAT_S, IDLE_BEAT_S

HELD_READ_LIMIT = 2_000  # held batches looked at per refresh: bounded by the fleet, never by the job

# A job's status: one vocabulary and one rule for every view.
JobStatus = Literal["empty", "queued", "running", "paused", "blocked", "writing", "partial", "done"]
JOB_STATUSES: tuple[JobStatus, ...] = get_args(JobStatus)
# Nothing more will happen without an operator: `genq monitor --until-done` stops at these.
FINISHED_STATUSES: tuple[JobStatus, ...] = ("partial", "done")


def job_status(*, total: int, finished: int, batches: int, batches_done: int, paused: bool,
               started: bool, failed: int = 0, blocked: bool = False) -> JobStatus:
    """finished = results + dead letters (failed of them). "done" once every shard is written and no
    prompt failed ("partial" with dead letters); "writing" while the last shards are written."""
    if total == 0:
        return "empty"
    if blocked:
        return "blocked"
    if finished >= total:
        if batches_done < batches:
            return "writing"
        return "partial" if failed else "done"
    if paused:
        return "paused"
    return "running" if started else "queued"


@dataclass
class WorkerCounters:
    done: int = 0
    failed: int = 0
    in_tok: int = 0
    out_tok: int = 0
    first_at: float | None = None
    last_at: float | None = None

    @classmethod
    def of(cls, raw: dict[bytes, bytes]) -> WorkerCounters:
        counts = [int(raw.get(name) or 0) for name in (b"done", b"failed", b"in_tok", b"out_tok")]
        times = [float(raw[name]) if raw.get(name) else None for name in (b"first_at", b"last_at")]
        return cls(*counts, *times)


def shown_state(status: WorkerStatus | None, now: float) -> str:
    """A worker's state as views show it (monitoring.md): "lost" once its record expired; "silent" once its next
    beat (every BEAT_S while busy or draining, else IDLE_BEAT_S) is 3 s late, a loaded host's slack."""
    if status is None:
        return "lost"
    every = BEAT_S if status.state in ("busy", "draining") else IDLE_BEAT_S
    late = status.state != "stopped" and now - status.heartbeat_at > every + 3 * BEAT_S
    return "silent" if late else status.state


def beating(status: WorkerStatus | None, now: float) -> bool:
    """Whether a worker's figures are of now (monitoring.md): its batches held, its requests running, it a worker
    on its jobs; not once its shown state is stopped, silent or lost."""
    return shown_state(status, now) not in ("stopped", "silent", "lost")


@dataclass
class WorkerView:
    name: str
    status: WorkerStatus | None  # None: the status key expired (lost) or never written
    counters: WorkerCounters = field(default_factory=WorkerCounters)
    inflight: InFlight | None = None  # this job's running requests on this worker
    held_unfinished: list[int] = field(default_factory=list)  # per batch of this job it holds, oldest first
    forgotten: bool = False  # not in the fleet any more (`genq workers --prune`): gone, not lost
    at: float = field(default_factory=time.time)  # when its record is judged: the snapshot's time

    @property
    def live_status(self) -> WorkerStatus | None:
        return self.status if beating(self.status, self.at) else None

    @property
    def live(self) -> bool:
        return self.live_status is not None

    @property
    def state(self) -> str:
        return ("gone" if self.forgotten else "lost") if self.status is None else self.status.state

    @property
    def running_tokens(self) -> list[int]:
        return list(self.inflight.tokens) if self.inflight is not None else []

    @property
    def decoding(self) -> int:
        """This job's requests in flight with a token made, at most the server's capacity."""
        n = sum(1 for t in self.running_tokens if t > 0)
        cap = self.status.server_capacity if self.status is not None else None
        return min(n, cap) if cap else n

    @property
    def slots(self) -> int:
        """Requests it can decode at once: its target, at most its server's capacity, over samples each;
        none while it drains (it finishes what it holds and takes no more) or its server is down."""
        s = self.live_status
        if s is None or s.state in ("draining", "server_down"):
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
    batches_held: int  # by beating workers, not yet written
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
    schedule: JobSchedule = field(default_factory=JobSchedule)  # docs/scheduling.md
    fleet_running: int = 0  # requests in flight on the live workers, every job's

    @property
    def live(self) -> list[WorkerView]:
        return [w for w in self.workers if w.live]

    @property
    def serving(self) -> list[WorkerView]:
        """Live workers whose server may run the job's prompts (its model), or that run some."""
        return [w for w in self.live if w.inflight is not None or self.config is None
                or self.config.served_by(w.status.model if w.status else None)]

    @property
    def running_tokens(self) -> list[int]:
        return [t for w in self.live for t in w.running_tokens]

    @property
    def in_flight(self) -> int:
        # In-flight records live 5 s after a request ends: never more than what is left.
        return min(len(self.running_tokens), max(0, self.total - self.completed - self.failed))

    @property
    def share(self) -> float:
        """Its part of the fleet's requests in flight."""
        return min(1.0, len(self.running_tokens) / self.fleet_running) if self.fleet_running else 0.0

    @property
    def queued(self) -> int:
        """Prompts not started anywhere."""
        return max(0, self.total - self.completed - self.failed - self.in_flight)

    @property
    def held(self) -> int:
        """Of those, the prompts in batches live workers hold."""
        return min(self.queued, sum(max(0, sum(w.held_unfinished) - len(w.running_tokens)) for w in self.live))

    @property
    def other_batches(self) -> int:
        """Batches neither written, held nor queued: retrying, failed in RQ, or orphaned."""
        return max(0, self.batches_total - self.batches_done - self.batches_held - self.batches_queued)

    @property
    def generated_tokens(self) -> int:
        """Output tokens produced so far, finished or not."""
        return self.out_tokens + sum(self.running_tokens)

    @property
    def decoding(self) -> int:
        return sum(w.decoding for w in self.live)

    @property
    def slots(self) -> int:
        return sum(w.slots for w in self.serving)

    @property
    def first_at(self) -> float | None:
        return min((w.counters.first_at for w in self.workers if w.counters.first_at), default=None)

    @property
    def last_at(self) -> float | None:
        return max((w.counters.last_at for w in self.workers if w.counters.last_at), default=None)

    @property
    def is_done(self) -> bool:
        return self.total > 0 and self.completed + self.failed >= self.total

    @property
    def status(self) -> JobStatus:
        finished = self.completed + self.failed
        return job_status(total=self.total, finished=finished, batches=self.batches_total,
                          batches_done=self.batches_done, paused=self.paused,
                          started=finished > 0 or self.in_flight > 0, failed=self.failed,
                          blocked=self.blocked is not None)


def read_job(conn: redis.Redis, job: str, workers: dict[str, WorkerStatus | None] | None = None, *,
             queued: int = 0, rq_queued: int = 0, at: float | None = None) -> JobSnapshot | None:
    """The job's snapshot at `at` (default now), or None when Redis has no such job. `workers`: fleet.statuses;
    queued, rq_queued: RQ's counts of the job's batches and of all (genq.monitor.rqqueue)."""
    at = time.time() if at is None else at
    if workers is None:
        workers = fleet.statuses(conn)
    with conn.pipeline(transaction=False) as pipe:
        pipe.get(keys.job_config(job))
        pipe.hgetall(keys.job_stats(job))
        pipe.zcard(keys.job_batches(job))
        pipe.scard(keys.job_done(job))
        pipe.hlen(keys.job_dlq(job))
        pipe.hgetall(keys.job_hist(job))
        pipe.smembers(keys.job_workers(job))
        pipe.exists(keys.job_paused(job), keys.PAUSED)
        pipe.hlen(keys.job_shards(job))
        pipe.sismember(keys.JOBS, job)
        pipe.get(keys.job_blocked(job))
        pipe.get(keys.job_schedule(job))
        (raw_config, stats, n_batches, n_done, n_dlq, hist, members, paused, shards, known, raw_block,
         raw_schedule) = pipe.execute()
    if raw_config is None and not stats and not known:
        return None
    if shards and scripts.SHARD_RECORDS.encode() not in stats:
        # Shards written by a genq that kept no totals: count them once, and keep the totals.
        scripts.evaluate(conn, scripts.COUNT_SHARDS, scripts.count_shards_call(job))
        stats = conn.hgetall(keys.job_stats(job))
    config = unpack(raw_config, JobConfig) if raw_config else None
    members = {w.decode() for w in members}
    names = sorted(set(workers) | members)
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(keys.worker_stats(job, name))
            pipe.get(keys.job_inflight(job, name))
        replies = pipe.execute()
    # Shown: workers with counters or in-flight requests here, and live ones whose server may run the job.
    views = [v for v in (WorkerView(name, workers.get(name), WorkerCounters.of(raw_stats),
                                    unpack(raw_inflight, InFlight) if raw_inflight else None,
                                    forgotten=name not in workers, at=at)
                         for name, raw_stats, raw_inflight in zip(names, replies[::2], replies[1::2]))
             if v.name in members or v.inflight is not None
             or (s := v.live_status) is not None and (config is None or config.served_by(s.model))]
    created = stats.get(b"created_at")
    return JobSnapshot(
        job=job, at=at, config=config,
        total=int(stats.get(b"total") or 0), created_at=float(created) if created else None,
        batches_total=int(n_batches), batches_done=int(n_done),
        batches_held=_held_batches(conn, job, views, config.batch_size if config else 0,
                                   {n for n, s in workers.items() if beating(s, at)}),
        batches_queued=queued, rq_queued=rq_queued,
        completed=sum(v.counters.done for v in views), failed=int(n_dlq),
        in_tokens=sum(v.counters.in_tok for v in views), out_tokens=sum(v.counters.out_tok for v in views),
        hist={int(b): int(n) for b, n in hist.items()}, workers=views, paused=bool(paused), shards=int(shards),
        shard_bytes=int(stats.get(scripts.SHARD_BYTES.encode()) or 0),
        shard_records=int(stats.get(scripts.SHARD_RECORDS.encode()) or 0),
        blocked=unpack(raw_block, JobBlock) if raw_block else None, schedule=jobs.schedule_of(raw_schedule),
        fleet_running=sum(s.in_flight for s in workers.values() if s is not None and beating(s, at)),
    )


def _held_batches(conn: redis.Redis, job: str, views: list[WorkerView], batch_size: int, beats: set[str]) -> int:
    """The job's batches (with a record) beating workers name or their live engines lease; fills each view's
    held_unfinished (the batch size less its stored results)."""
    asks = [(v, b.batch) for v in views if (s := v.live_status) is not None and v.inflight is not None
            for b in sorted(s.batches) if b.job == job][:HELD_READ_LIMIT]
    with conn.pipeline(transaction=False) as pipe:
        for _, bid in asks:
            pipe.exists(keys.batch(job, bid))
            pipe.hlen(keys.batch_results(job, bid))
        pipe.hgetall(keys.job_leases(job))
        *replies, leases = pipe.execute()
    for i, (view, _) in enumerate(asks):
        if replies[2 * i]:
            view.held_unfinished.append(max(0, batch_size - int(replies[2 * i + 1])))
    held = sum(len(v.held_unfinished) for v in views)
    named = {bid for _, bid in asks}
    unnamed = [(bid.decode(), holder) for bid, value in leases.items()
               if (holder := ledger.lease_holder(value)) and bid.decode() not in named][:HELD_READ_LIMIT]
    if not unnamed:
        return held
    with conn.pipeline(transaction=False) as pipe:
        for bid, holder in unnamed:
            pipe.get(keys.engine_alive(holder))  # the engine's worker
            pipe.exists(keys.batch(job, bid))
        alive = pipe.execute()
    return held + sum(1 for worker, batch in zip(*[iter(alive)] * 2) if batch and worker and worker.decode() in beats)


def prompt_state(conn: redis.Redis, job: str, batch: str, prompt_id: str
                 ) -> tuple[bytes | None, str | None, str | None, bool, bool]:
    """`genq status JOB ID` of a pending batch's prompt: its stored result, the engine of a claim that counts (alive,
    under the batch's lease), the lease holder, whether it is alive, and whether the job (or fleet) is paused."""
    with conn.pipeline(transaction=False) as pipe:
        pipe.hget(keys.batch_results(job, batch), prompt_id)
        pipe.hget(keys.batch_claims(job, batch), prompt_id)
        pipe.hget(keys.job_leases(job), batch)
        pipe.exists(keys.job_paused(job), keys.PAUSED)
        result, claim, lease, paused = pipe.execute()
    claimer, _, claim_token = claim.decode().partition(" ") if claim else ("", "", "")
    token, holder = ledger.lease_token(lease), ledger.lease_holder(lease)
    claim_alive, holder_alive = (bool(conn.exists(keys.engine_alive(e))) if e else False for e in (claimer, holder))
    counts = claim_alive and claim_token == token
    return result, claimer if counts else None, holder or None, holder_alive, bool(paused)
