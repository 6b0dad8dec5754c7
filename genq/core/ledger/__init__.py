"""genq's ledger: the truth about every batch. RQ only carries batches to workers.

A batch of a job is, at any moment, exactly one of:
- done: in keys.job_done (its shard and manifest marker are written);
- carried: not done, and keys.job_transport names a live RQ job for it (queued in
  `genq`, or started by an engine that heartbeats and holds its lease: TAKE);
- stranded: anything else (the RQ job failed, finished early, was deleted, was lost
  in a Redis restart, or was queued by genq 0.1 as a pickle). The reconciler finds
  these and queues them again, so an unknown bug in this class costs a delay, not
  a job.

A **lease** is one delivery of a batch to one worker engine: a random token the engine
draws when it takes the batch off RQ's queue (TAKE), recorded as the batch's current one
(keys.job_leases); an engine whose lease is no longer current (a frozen worker woke up, the
batch was queued again and taken by another) stops sending that batch's prompts.
A second holder is harmless anyway: each prompt's outcome is written once (first
writer wins, a result and a dead letter exclude each other: worker/results.py), the
shard is built from what Redis recorded (every writer writes the same bytes), and
releasing a batch is conditional and idempotent (RELEASE: genq/core/scripts/release.lua).

A job's **incarnation** (JobConfig.incarnation) is the life of its name: a job deleted and
enqueued again under the same name is a new one. Every script that writes for a job
(RECORD, the claim scripts, RELEASE, ADOPT: genq/core/scripts/) is given the incarnation its
caller works for and refuses to write for another one (scripts/_incarnation.lua), so nothing
of a deleted job lands in its successor.

This module is the protocol; the package's other modules are every read and write the rest of
genq makes of a key, named for what they do (docs/architecture.md, "The scripts and the ledger's
boundary"): jobs (a job's own records), fleet (workers and servers), letters (dead letters),
leasing (the engine's side of a lease), parked (paused jobs' batches), figures (the monitor's reads).
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, field

import redis
from redis.client import Pipeline
from redis.exceptions import WatchError
from rq.job import Job as RqJob
from rq.registry import FailedJobRegistry

from genq.core import keys
from genq.core.queueing import carried, enqueue_batch_jobs, fetch_rq_jobs, list_jobs, rq_queue
from genq.core.timings import RECONCILE_EVERY_S, STRANDED_CONFIRM_S

log = logging.getLogger("genq.ledger")

def _lease_parts(value: bytes | str | None) -> tuple[str | None, str | None]:
    """A lease value ("TOKEN INSTANCE") as (token, engine instance)."""
    if value is None:
        return None, None
    text = value.decode() if isinstance(value, bytes) else value
    token, _, instance = text.partition(" ")
    return token, instance or None


def lease_token(value: bytes | str | None) -> str | None:
    return _lease_parts(value)[0]


def lease_holder(value: bytes | str | None) -> str | None:
    """The engine instance named by a lease value."""
    return _lease_parts(value)[1]


@dataclass
class Outlook:
    """What the ledger says about every job's batches."""

    pending: dict[str, list[str]] = field(default_factory=dict)  # job -> batches not done
    requeued: list[tuple[str, str]] = field(default_factory=list)  # (job, batch) queued again this pass
    # RQ jobs of done batches still "started" in RQ: their loops are returning (a moment), or
    # died running them (a stock RQ worker, or genq before the engine took batches itself); cleared once
    # seen in two passes.
    finishing: int = 0

    @property
    def unfinished(self) -> int:
        return sum(len(b) for b in self.pending.values())


class Reconciler:
    """Finds stranded batches and queues them again (see the module docstring).

    Kept by each worker; a fleet-wide lock makes one pass at a time do the work.
    Remembers what looked stranded in its last pass to confirm it in the next.
    """

    def __init__(self, conn: redis.Redis, owner: str) -> None:
        self.conn = conn
        self.owner = owner
        self._suspects: dict[tuple[str, str, str | None], float] = {}
        self._done_started: dict[str, float] = {}  # RQ job id -> when first seen started with its batch done

    def pass_once(self, *, force: bool = False) -> Outlook:
        """One pass over every job. `force` skips the fleet lock (a burst worker deciding to exit)."""
        outlook = Outlook()
        if not force and not self.conn.set(keys.RECONCILE_LOCK, self.owner, nx=True, px=int(RECONCILE_EVERY_S * 900)):
            outlook.pending = self.pending()
            return outlook
        queued = self._queued_ids()
        now = time.monotonic()
        seen: set[tuple[str, str, str | None]] = set()
        for job in list_jobs(self.conn):
            batches = self._pending_of(job)
            if not batches:
                continue
            outlook.pending[job] = batches
            transport = self.conn.hmget(keys.job_transport(job), batches)
            rq_ids = [t.decode() if t else None for t in transport]
            holders = [lease_holder(v) for v in self.conn.hmget(keys.job_leases(job), batches)]
            live = self._live(rq_ids, holders, queued)
            for batch, rq_id, ok in zip(batches, rq_ids, live):
                if ok:
                    continue
                key = (job, batch, rq_id)
                seen.add(key)
                first = self._suspects.setdefault(key, now)
                if now - first >= STRANDED_CONFIRM_S and self._requeue(job, batch, rq_id):
                    outlook.requeued.append((job, batch))
                    self._suspects.pop(key, None)
        self._suspects = {k: v for k, v in self._suspects.items() if k in seen}
        outlook.finishing = self._clear_done_started(now)
        self._clear_done_failed()
        return outlook

    def _clear_done_started(self, now: float) -> int:
        """RQ jobs left "started" for batches the ledger has done (a worker that died before
        its job function returned) leave RQ's started registry, so `rq info` tells the truth;
        how many are still waiting for confirmation. Likewise RQ jobs of done batches in RQ's
        intermediate list (a Redis restored from a snapshot taken while a loop was taking one:
        its batch was written since)."""
        queue = rq_queue(self.conn)
        executions: dict[str, list[bytes]] = {}
        for entry in self.conn.zrange(queue.started_job_registry.key, 0, -1):
            executions.setdefault(entry.decode().partition(":")[0], []).append(entry)
        for raw_id in self.conn.lrange(queue.intermediate_queue_key, 0, -1):
            executions.setdefault(raw_id.decode(), [])
        seen: dict[str, float] = {}
        for rq_id, carried_batch in self._of_done_batches(list(executions)):
            first = seen[rq_id] = self._done_started.get(rq_id, now)
            if now - first >= STRANDED_CONFIRM_S:
                with self.conn.pipeline(transaction=True) as pipe:
                    forget_rq_job(pipe, rq_id, executions[rq_id])
                    pipe.execute()
                del seen[rq_id]
                where = "started by a worker that died running it" if executions[rq_id] else "in RQ's intermediate list"
                log.info("RQ job %s of done batch %s/%s was left %s; removed it from RQ's registries",
                         rq_id, *carried_batch, where)
        self._done_started = seen
        return len(seen)

    def _clear_done_failed(self) -> None:
        """RQ jobs that failed for batches the ledger has done (a job function that gave up on a
        frozen engine which then finished the batch; RQ's rq#2424) leave RQ's
        failed registry: the batch is complete, and `rq info` and `genq dlq` must not show it
        as failed. A done batch never runs again, so one pass is enough."""
        failed = FailedJobRegistry(queue=rq_queue(self.conn))
        for rq_id, carried_batch in self._of_done_batches([i.decode() for i in self.conn.zrange(failed.key, 0, -1)]):
            with self.conn.pipeline(transaction=True) as pipe:
                forget_rq_job(pipe, rq_id)
                pipe.execute()
            log.info("RQ job %s of done batch %s/%s had failed after its batch was handed over; "
                     "removed it from RQ's failed registry", rq_id, *carried_batch)

    def _of_done_batches(self, rq_ids: list[str]) -> list[tuple[str, tuple[str, str]]]:
        """The genq batch jobs among these RQ job ids whose batch the ledger has done, or does
        not have at all while it has the job: a batch lost with Redis (restarted empty,
        flushed) whose prompts were queued again under other numbers (genq recover)."""
        batch_jobs = [(rq_id, c) for rq_id, job in zip(rq_ids, fetch_rq_jobs(self.conn, rq_ids))
                      if (c := carried(job)) is not None]
        with self.conn.pipeline(transaction=False) as pipe:  # one round trip, not one per job
            for _, (job_name, batch) in batch_jobs:
                pipe.sismember(keys.job_done(job_name), batch)
                pipe.zscore(keys.job_batches(job_name), batch)
                pipe.exists(keys.job_config(job_name))
            answers = pipe.execute()
        over = [done or (score is None and known) for done, score, known in zip(*[iter(answers)] * 3)]
        return [found for found, is_over in zip(batch_jobs, over) if is_over]

    def drop_legacy_jobs(self) -> int:
        """Remove RQ jobs that are not JSON (queued by genq 0.1, pickled) from the queue, without
        unpickling them; their batches have no transport entry, so a pass queues them again."""
        queue = rq_queue(self.conn)
        dropped = 0
        for raw_id in self.conn.lrange(queue.key, 0, -1):
            job_key = RqJob.key_for(raw_id.decode())
            data = self.conn.hget(job_key, "data")
            try:
                legacy = data is not None and zlib.decompress(data)[:1] not in (b"[", b"{")
            except zlib.error:
                legacy = True
            if legacy:
                with self.conn.pipeline(transaction=True) as pipe:
                    pipe.lrem(queue.key, 0, raw_id)
                    pipe.delete(job_key)
                    pipe.execute()
                dropped += 1
        if dropped:
            log.warning("dropped %d RQ jobs that were not JSON (queued by genq 0.1, pickled): "
                        "their batches are queued again", dropped)
        return dropped

    def pending(self) -> dict[str, list[str]]:
        return {job: b for job in list_jobs(self.conn) if (b := self._pending_of(job))}

    def _pending_of(self, job: str) -> list[str]:
        if self.conn.exists(keys.job_blocked(job), keys.job_paused(job)):
            return []  # blocked or paused (worker/parking.py): its batches wait, parked, for `genq resume --job`
        with self.conn.pipeline(transaction=False) as pipe:
            pipe.zrange(keys.job_batches(job), 0, -1)
            pipe.smembers(keys.job_done(job))
            all_batches, done = pipe.execute()
        return [b.decode() for b in all_batches if b not in done]

    def _queued_ids(self) -> set[bytes]:
        """Ids in RQ's queue. Not its intermediate list: a job a loop moved there and then died
        with stays "queued" there until RQ's own cleanup, which only running loops do (a burst
        worker's have left); seen there in two passes, it is stranded like any other."""
        return set(self.conn.lrange(rq_queue(self.conn).key, 0, -1))

    def _live(self, rq_ids: list[str | None], holders: list[str | None], queued: set[bytes]) -> list[bool]:
        """Whether each batch's RQ job carries it: queued in RQ's queue, or started by a loop
        whose engine heartbeats and holds the batch's lease (a worker that died before handing
        the batch over leaves it "started" for an engine that never got it)."""
        # A job in RQ's queue will be taken: live, whatever else it says (and not worth
        # fetching: early in a big job nearly every pending batch is there).
        known = [i for i in rq_ids if i and i.encode() not in queued]
        jobs = {i: j for i, j in zip(known, fetch_rq_jobs(self.conn, known)) if j is not None} if known else {}
        # TAKE names the engine instance that took the batch as the RQ job's worker.
        engines = {j.worker_name for j in jobs.values() if j.get_status(refresh=False) == "started"}
        engines.discard(None)
        alive = {}
        if engines:
            names = sorted(e for e in engines if e)
            alive = dict(zip(names, self.conn.mget([keys.engine_alive(e) for e in names])))
        out = []
        for rq_id, holder in zip(rq_ids, holders):
            if rq_id and rq_id.encode() in queued:
                out.append(True)
                continue
            job = jobs.get(rq_id) if rq_id else None
            if job is None or rq_id is None:
                out.append(False)
                continue
            status = job.get_status(refresh=False)
            if status == "started":
                engine = job.worker_name or ""
                out.append(alive.get(engine) is not None and holder == engine)
            else:  # "queued" but not in the queue (lost from it) is stranded too
                out.append(status in ("scheduled", "deferred"))
        return out

    def _requeue(self, job: str, batch: str, stale_rq_id: str | None) -> bool:
        """Queue the batch again if it is still stranded with the same transport. The stale RQ
        job leaves RQ altogether (failed, started and intermediate registries, its hash): the
        ledger superseded it, a transport failure is not the batch's, and `rq info` must not
        go on showing a dead loop's job as started or a redelivered batch as failed."""
        started = rq_queue(self.conn).started_job_registry
        with self.conn.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(keys.job_transport(job), keys.job_done(job))
                current = pipe.hget(keys.job_transport(job), batch)
                if (current.decode() if current else None) != stale_rq_id or pipe.sismember(keys.job_done(job), batch):
                    return False
                if not pipe.exists(keys.batch(job, batch)):
                    return False  # deleted with its job
                executions = [e for e in pipe.zrange(started.key, 0, -1)
                              if stale_rq_id and e.decode().partition(":")[0] == stale_rq_id]
                pipe.multi()
                enqueue_batch_jobs(pipe, self.conn, [(job, batch, 0)], at_front=True)
                if stale_rq_id:
                    forget_rq_job(pipe, stale_rq_id, executions)
                pipe.hincrby(keys.job_stats(job), "redeliveries", 1)
                pipe.execute()
            except WatchError:
                return False
        log.warning("batch %s/%s had no live RQ job (was %s); queued it again", job, batch, stale_rq_id or "none")
        return True


def forget_rq_job(pipe: Pipeline, rq_id: str, executions: list[bytes] | None = None) -> None:
    """Take an RQ job out of RQ altogether, once the ledger has no use for it: its failed
    registry, its intermediate list, its started registry (`executions`: the job's entries
    there) and its hash. What `rq info` shows then matches the ledger."""
    queue = rq_queue(pipe)
    pipe.zrem(FailedJobRegistry(queue=queue).key, rq_id)
    pipe.lrem(queue.intermediate_queue_key, 0, rq_id)
    if executions:
        pipe.zrem(queue.started_job_registry.key, *executions)
    pipe.delete(RqJob.key_for(rq_id))
