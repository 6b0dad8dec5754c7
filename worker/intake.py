"""The engine takes batches off RQ's queue itself (TAKE: RQ job started and batch leased in one script): while
fewer than --prefetch are held, or (prefetch - 1) batches' worth is not left unsent, or the queue's next batch
outranks what waits here. Shares: which held prompts are claimed next, the highest priority first, then the job
with the fewest claimed or in flight on the fleet over its weight (FLEET_SHARE; docs/scheduling.md)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import Counter

import redis
import redis.asyncio as aioredis

from genq.core import scripts
from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger.jobs import job_names, jobs_now
from genq.core.queueing import batch_of_description, rq_worker
from genq.core.records import BatchRef, JobSchedule
from genq.core.waits import retrying, wait_event
from genq.worker.batches import Batches
from genq.worker.dispatch import Dispatcher
from genq.worker.options import WorkerOptions

log = logging.getLogger("genq.worker")

BUSY_POLL_S = 0.3  # wanting a batch and the last TAKE found none: look again this often,
IDLE_POLL_S = 30.0  # or this often after a while: every queueing publishes a WAKE that ends the wait
FULL_POLL_S = 0.05  # holding enough: whether that changed is a look at this engine's own state, no Redis
FOREIGN_EVERY_S = 2.0  # the skip list's view of other models' jobs is this fresh
RQ_BEAT_S = 20.0  # the RQ worker key's heartbeat...
RQ_TTL_S = 60  # ...and its life: a killed engine leaves `rq info` within this
MAX_EXTRA = 14  # batches taken beyond --prefetch while held ones drain their long tails

REFRESH_EVERY_S = 1.0
FRESH_S = 3  # another engine's count stops counting this long after its last refresh


class Shares:
    def __init__(self, conn: aioredis.Redis, queue_key: str, instance: str, batches: Batches) -> None:
        self.conn, self.queue_key, self.instance = conn, queue_key, instance
        self.batches = batches  # what this engine holds, claimed and runs
        self.sched: dict[str, JobSchedule] = {}
        self.head: str | None = None  # the job of the queue's next batch (None: empty, or not read)
        self.others: dict[str, int] = {}  # prompts per job claimed or in flight on the fleet's other engines
        self._published: set[str] = set()  # jobs this engine's count is published for
        self._head = conn.register_script(scripts.QUEUE_HEAD)
        self._share = conn.register_script(scripts.FLEET_SHARE)

    def _mine(self) -> dict[str, int]:
        """This engine's prompts claimed or in flight, per job."""
        return Counter(t.batch.ref.job for t in itertools.chain(self.batches.running, self.batches.todo.ready))

    def priority(self, job: str) -> int:
        return self.sched.get(job, JobSchedule()).priority

    def weight(self, job: str) -> float:
        return self.sched.get(job, JobSchedule()).weight

    async def run(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_EVERY_S)
            jobs = sorted(self.batches.held.all_jobs())
            if not jobs and not self._published:
                self.head = None
                continue  # idle: nothing read (worker/heartbeat.py)
            try:
                await self.refresh(jobs)
            except (redis.RedisError, OSError) as exc:
                log.debug("schedules not read: %s", exc)

    async def refresh(self, jobs: list[str]) -> None:
        counts = self._mine()
        # Jobs left since the last refresh publish 0: their entries go now, not FRESH_S later.
        mine = {job: counts.get(job, 0) for job in sorted(set(jobs) | self._published)}
        async with self.conn.pipeline(transaction=False) as pipe:
            script_keys, args = scripts.fleet_share_call(self.instance, FRESH_S, mine)
            await self._share(keys=script_keys, args=args, client=pipe)
            if jobs:
                ledger_jobs.stage_schedules(pipe, jobs)
                script_keys, args = scripts.queue_head_call(self.queue_key)
                await self._head(keys=script_keys, args=args, client=pipe)
            shared, *rest = await pipe.execute()
        self._published = {job for job, n in mine.items() if n}
        self.others = dict(zip(mine, shared))
        if not rest:
            self.head = None
            return
        raws, head = rest
        self.sched.update({job: ledger_jobs.schedule_of(raw) for job, raw in zip(jobs, raws)})
        found = batch_of_description(head)
        self.head = found[0] if found else None
        if self.head is not None and self.head not in self.sched:
            self.sched[self.head] = (await ledger_jobs.jobs_now(self.conn, [self.head]))[0].schedule

    def wants_head(self, low: int = 1) -> bool:
        """Whether the queue's next batch should be taken now although --prefetch are held: it outranks what
        waits here, or ties it with fewer than `low` waiting (taken only once dry, the second of two equal jobs
        started 38% of the prompts, tests/test_scheduling.py). What waits is counted only once the head is known."""
        if self.head is None or not (waiting := self.batches.todo.by_job()):
            return False
        best = max(self.priority(j) for j in waiting)
        head = self.priority(self.head)
        return head > best or (head == best and waiting.get(self.head, 0) < low)

    def plan(self, waiting: dict[str, int], n: int) -> list[tuple[str, int]]:
        """How many of n claims go to each job with prompts waiting, in the order to claim them."""
        out: Counter[str] = Counter()
        load = Counter(self._mine()) + Counter(self.others)
        for priority in sorted({self.priority(j) for j in waiting}, reverse=True):
            left = {j: k for j, k in waiting.items() if self.priority(j) == priority and k > 0}
            while n > 0 and left:
                job = min(left, key=lambda j: (load[j] / self.weight(j), j))
                out[job] += 1
                load[job] += 1
                n -= 1
                left[job] -= 1
                if not left[job]:
                    del left[job]
        return list(out.items())


def run_batch(job: str, batch_id: str) -> None:
    """What a stock RQ worker runs for a genq batch: genq's engine takes batches itself (TAKE)."""
    raise RuntimeError(f"batch {job}/{batch_id}: genq batches are run by `genq worker`, not by a stock RQ worker")


class Intake:
    def __init__(self, opts: WorkerOptions, batches: Batches, dispatcher: Dispatcher, shares: Shares) -> None:
        self.conn, self.sync_conn, self.opts, self.instance = batches.conn, batches.sync_conn, opts, batches.instance
        self.batches, self.held = batches, batches.held  # loads what is taken
        self.dispatcher, self.shares = dispatcher, shares  # whether the engine takes new work; priorities
        self.queued = batches.written_again  # set too by the wake listener when batches are queued
        self.exhausted = False  # the last look at the queue found nothing for this engine (--burst: leave?)
        self.foreign: set[str] = set()  # jobs of a model this engine's server does not serve
        self._foreign_at = float("-inf")
        self._take = self.conn.register_script(scripts.TAKE)
        self._rq = rq_worker(self.sync_conn, self.instance)

    def wants_batch(self) -> bool:
        if not self.dispatcher.accepting():
            return False
        base, held = self.opts.loops, len(self.held)
        if held < base:
            return True
        if held >= base + MAX_EXTRA:
            return False  # parked prompts are not work: no more batches for them
        if self.shares.wants_head(max(1, self.dispatcher.controller.target // 2)):
            return True  # the queue's next batch outranks what waits here: not after a held batch's long tail
        # (prefetch - 1) batches' worth unsent, counted in prompts without an outcome and not in flight
        # (several held batches can be in their heavy tails at once).
        size = max((h.config.batch_size for h in self.held.values()), default=0)
        unsent = sum(len(h.unfinished) for h in self.held.values() if not h.dropped) - len(self.dispatcher.running)
        return unsent < (base - 1) * size

    async def run(self) -> None:
        # Redis away or refusing writes (full, a replica) at the start: waited out, as every write is.
        await retrying(lambda: asyncio.to_thread(self._rq_birth), "registering in rq info")
        beat_at = quiet_since = time.monotonic()
        try:
            while True:
                if time.monotonic() - beat_at >= RQ_BEAT_S:
                    try:
                        await asyncio.to_thread(self._rq_beat)
                        beat_at = time.monotonic()
                    except (redis.RedisError, OSError) as exc:
                        log.debug("rq info heartbeat: %s", exc)
                if not self.wants_batch():
                    await asyncio.sleep(FULL_POLL_S)
                    continue
                taken = await self.take()
                self.exhausted = not taken
                if taken:
                    quiet_since = time.monotonic()
                    continue
                idle = time.monotonic() - quiet_since > 10 * BUSY_POLL_S
                await wait_event(self.queued, IDLE_POLL_S if idle else BUSY_POLL_S)
                self.queued.clear()
        finally:
            with contextlib.suppress(redis.RedisError, OSError):  # else its key lapses within RQ_TTL_S
                await asyncio.to_thread(self._rq.register_death)

    async def take(self) -> bool:
        """TAKE one batch this engine may run, and load it; False if the queue has none. A TAKE whose answer was
        lost is sent again with the same token and answers the batch the first one took."""
        await retrying(self._refresh_foreign, "reading the jobs")
        token = uuid.uuid4().hex
        skip = sorted(self.foreign | self.batches.unwritten_jobs())
        rq_now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())  # as RQ writes it (rq.utils.utcformat)
        script_keys, args = scripts.take_call(self.instance, token, rq_now, skip)
        got = await retrying(lambda: self._take(keys=script_keys, args=args), "taking a batch")
        if not got:
            return False
        ref = BatchRef(got[0].decode(), got[1].decode())
        # Leased to this live engine now: no one else takes it, so its load is waited through (Redis away).
        await retrying(lambda: self._load(token, ref), f"loading batch {ref}")
        return True

    async def _load(self, token: str, ref: BatchRef) -> None:
        config = (await jobs_now(self.conn, [ref.job]))[0].config
        if self.batches.renewed(ref, token, config):
            return
        if config is not None and (config := await self.dispatcher.watch.admit(config)) is None:  # `auto` pinned
            self.foreign.add(ref.job)  # another model's job: back to the queue, and skipped from now on
            await self.batches.hand_back(ref, token)
            return
        await self.batches.load(token, ref, config)

    async def _refresh_foreign(self) -> None:
        """Jobs whose model is pinned to one this server does not serve."""
        if time.monotonic() - self._foreign_at < FOREIGN_EVERY_S:
            return
        jobs = sorted(await job_names(self.conn))
        self.foreign = {job for job, now in zip(jobs, await jobs_now(self.conn, jobs))
                        if now.config is not None and not self.dispatcher.watch.takes(now.config)}
        self._foreign_at = time.monotonic()

    def _rq_birth(self) -> None:
        with contextlib.suppress(ValueError):  # "an active worker named ...": a try before this one got that far
            self._rq.register_birth()
        self._rq_beat()

    def _rq_beat(self) -> None:
        self._rq.set_state("busy" if self.held else "idle")
        self._rq.heartbeat(RQ_TTL_S)

