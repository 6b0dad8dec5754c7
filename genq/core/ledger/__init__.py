"""genq's ledger, the truth about every batch (docs/exactly-once.md): a batch is done, carried (its RQ job is
queued, or started by a live engine holding its lease), or stranded, and then queued again. A lease is one
delivery of a batch to one engine ("TOKEN INSTANCE" in keys.job_leases); RQ only carries batches."""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.client import Pipeline
from redis.exceptions import WatchError
from rq.job import Job as RqJob
from rq.registry import FailedJobRegistry

from genq.core import keys
from genq.core.queueing import carried, enqueue_batch_jobs, fetch_rq_jobs, list_jobs, rq_queue
from genq.core.timings import RECONCILE_EVERY_S, STRANDED_CONFIRM_S

log = logging.getLogger("genq.ledger")


def lease_token(value: bytes | str | None) -> str | None:
    return None if value is None else (value.decode() if isinstance(value, bytes) else value).partition(" ")[0]


def lease_holder(value: bytes | str | None) -> str | None:
    return (value.decode() if isinstance(value, bytes) else value or "").partition(" ")[2] or None


@dataclass
class Outlook:
    pending: dict[str, list[str]]  # job -> batches not done
    requeued: list[tuple[str, str]] = field(default_factory=list)  # (job, batch) queued again this pass
    finishing: int = 0  # RQ jobs of done batches still "started" in RQ: cleared once seen in two passes

    @property
    def unfinished(self) -> int:
        return sum(len(b) for b in self.pending.values())


class Reconciler:
    """Finds stranded batches and queues them again: one pass at a time fleet-wide (a lock), and what
    looked stranded in one pass is confirmed in the next."""

    def __init__(self, conn: redis.Redis, owner: str) -> None:
        self.conn, self.owner = conn, owner
        self._suspects: dict[tuple[str, str, str | None], float] = {}
        self._done_started: dict[str, float] = {}  # RQ job id -> when first seen started with its batch done

    def pass_once(self, *, force: bool = False) -> Outlook:
        """One pass over every job. `force` skips the fleet lock (a burst worker deciding to exit)."""
        # A blocked or paused job's batches wait, parked, for `genq resume --job` (worker/gate.py).
        jobs = [j for j in list_jobs(self.conn) if not self.conn.exists(keys.job_blocked(j), keys.job_paused(j))]
        outlook = Outlook({job: b for job in jobs if (b := pending_batches(self.conn, job))})
        if not force and not self.conn.set(keys.RECONCILE_LOCK, self.owner, nx=True, px=int(RECONCILE_EVERY_S * 900)):
            return outlook
        queued = set(self.conn.lrange(rq_queue(self.conn).key, 0, -1))
        now = time.monotonic()
        seen: set[tuple[str, str, str | None]] = set()
        for job, batches in outlook.pending.items():
            rq_ids = [t.decode() if t else None for t in self.conn.hmget(keys.job_transport(job), batches)]
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
        outlook.finishing = self._clear_done(now)
        return outlook

    def _clear_done(self, now: float) -> int:
        """RQ jobs of done batches (or of batches their job no longer knows: `genq recover` queued them again
        under another number) leave RQ's failed registry, and (confirmed in a later pass) its started registry
        and intermediate list, so `rq info` and `genq dlq` tell the truth; how many wait."""
        queue = rq_queue(self.conn)
        executions: dict[str, list[bytes]] = {}
        for entry in self.conn.zrange(queue.started_job_registry.key, 0, -1):
            executions.setdefault(entry.decode().partition(":")[0], []).append(entry)
        for raw_id in self.conn.lrange(queue.intermediate_queue_key, 0, -1):
            executions.setdefault(raw_id.decode(), [])
        failed = {i.decode() for i in self.conn.zrange(FailedJobRegistry(queue=queue).key, 0, -1)} - set(executions)
        rq_ids = [*executions, *sorted(failed)]
        batch_jobs = [(rq_id, c) for rq_id, job in zip(rq_ids, fetch_rq_jobs(self.conn, rq_ids))
                      if (c := carried(job)) is not None]
        with self.conn.pipeline(transaction=False) as pipe:  # one round trip, not one per job
            for _, (job_name, batch) in batch_jobs:
                pipe.sismember(keys.job_done(job_name), batch)
                pipe.zscore(keys.job_batches(job_name), batch)
                pipe.exists(keys.job_config(job_name))
            answers = pipe.execute()
        seen: dict[str, float] = {}
        for (rq_id, carried_batch), done, score, known in zip(batch_jobs, *[iter(answers)] * 3):
            if not (done or (score is None and known)):
                continue
            first = seen[rq_id] = self._done_started.get(rq_id, now)
            if rq_id in failed or now - first >= STRANDED_CONFIRM_S:
                with self.conn.pipeline(transaction=True) as pipe:
                    forget_rq_job(pipe, rq_id, executions.get(rq_id))
                    pipe.execute()
                del seen[rq_id]
                where = ("failed after its batch was handed over" if rq_id in failed
                         else "started by a worker that died running it" if executions[rq_id]
                         else "in RQ's intermediate list")
                log.info("RQ job %s of done batch %s/%s was left %s; removed it from RQ's registries",
                         rq_id, *carried_batch, where)
        self._done_started = seen
        return len(seen)

    def drop_legacy_jobs(self) -> int:
        """Remove RQ jobs that are not JSON (pickled by genq 0.1) without unpickling them; a pass queues
        their batches again."""
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
                self.conn.pipeline(transaction=True).lrem(queue.key, 0, raw_id).delete(job_key).execute()
                dropped += 1
        if dropped:
            log.warning("dropped %d RQ jobs that were not JSON (queued by genq 0.1, pickled): "
                        "their batches are queued again", dropped)
        return dropped

    def _live(self, rq_ids: list[str | None], holders: list[str | None], queued: set[bytes]) -> list[bool]:
        """Whether each batch's RQ job carries it: queued, or started by a live engine holding its lease (TAKE
        names the engine instance as the RQ job's worker); "scheduled" and "deferred" count, "queued" outside
        the queue does not (lost from it)."""
        known = [i for i in rq_ids if i and i.encode() not in queued]
        jobs = {i: j for i, j in zip(known, fetch_rq_jobs(self.conn, known)) if j is not None}
        status: dict[str, Any] = {i: j.get_status(refresh=False) for i, j in jobs.items()}
        engines = sorted({j.worker_name for i, j in jobs.items() if j.worker_name and status[i] == "started"})
        alive = {e for e, a in zip(engines, self.conn.mget([keys.engine_alive(e) for e in engines]) if engines else [])
                 if a is not None}
        return [rq_id is not None and (rq_id.encode() in queued or status.get(rq_id) in ("scheduled", "deferred")
                                       or status.get(rq_id) == "started" and holder == jobs[rq_id].worker_name
                                       and holder in alive)
                for rq_id, holder in zip(rq_ids, holders)]

    def _requeue(self, job: str, batch: str, stale_rq_id: str | None) -> bool:
        """Queue the batch again if still stranded with the same transport; the stale RQ job leaves RQ."""
        started = rq_queue(self.conn).started_job_registry
        with self.conn.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(keys.job_transport(job), keys.job_done(job))
                current = pipe.hget(keys.job_transport(job), batch)
                if ((current.decode() if current else None) != stale_rq_id or pipe.sismember(keys.job_done(job), batch)
                        or not pipe.exists(keys.batch(job, batch))):  # done, or deleted with its job
                    return False
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


def pending_batches(conn: redis.Redis, job: str) -> list[str]:
    """The job's batches not done, in order (one round trip)."""
    with conn.pipeline(transaction=False) as pipe:
        pipe.zrange(keys.job_batches(job), 0, -1)
        pipe.smembers(keys.job_done(job))
        listed, done = pipe.execute()
    return [b.decode() for b in listed if b not in done]


def forget_rq_job(pipe: Pipeline, rq_id: str, executions: list[bytes] | None = None) -> None:
    """An RQ job out of RQ's failed registry, intermediate list, started registry (`executions`: its
    entries there) and its hash, so `rq info` matches the ledger."""
    queue = rq_queue(pipe)
    pipe.zrem(FailedJobRegistry(queue=queue).key, rq_id)
    pipe.lrem(queue.intermediate_queue_key, 0, rq_id)
    if executions:
        pipe.zrem(queue.started_job_registry.key, *executions)
    pipe.delete(RqJob.key_for(rq_id))
