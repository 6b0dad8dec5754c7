"""The engine takes batches off RQ's queue itself (TAKE: the RQ job started under this engine's name
and the batch leased in one script, so `rq info` stays truthful): while fewer than --prefetch are held,
or (prefetch - 1) batches' worth is not left unsent, or the queue's next batch outranks what waits here.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import redis

from genq.core import scripts
from genq.core.ledger.jobs import job_names, jobs_now
from genq.core.queueing import rq_worker
from genq.core.records import BatchRef
from genq.core.waits import retrying, wait_event
from genq.worker.batches import Batches
from genq.worker.dispatch import Dispatcher
from genq.worker.idle import IdlePace
from genq.worker.options import WorkerOptions
from genq.worker.shares import Shares
from genq.worker.watch import AUTO, ModelGate, serves

log = logging.getLogger("genq.worker")

BUSY_POLL_S = 0.3  # wanting a batch and the last TAKE found none: look again this often,
IDLE_POLL_S = 30.0  # or this often after a while: every queueing publishes a WAKE that ends the wait
# Holding enough: whether that changed (prompts sent, a batch written) is a look at this engine's own
# state, no Redis, this often. At BUSY_POLL_S a fast server idled between batches: on an instant
# server one worker made 1,670 requests/s, 0.17 x a bare client's, batches written in pairs 0.3 s apart.
FULL_POLL_S = 0.05
FOREIGN_EVERY_S = 2.0  # the skip list's view of other models' jobs is this fresh
RQ_BEAT_S = 20.0  # the RQ worker key's heartbeat...
RQ_TTL_S = 60  # ...and its life: a killed engine leaves `rq info` within this
MAX_EXTRA = 14  # batches taken beyond --prefetch while held ones drain their long tails


def run_batch(job: str, batch_id: str) -> None:
    """What a stock RQ worker runs for a genq batch: genq's engine takes batches itself (TAKE)."""
    raise RuntimeError(f"batch {job}/{batch_id}: genq batches are run by `genq worker`, not by a stock RQ worker")


class Intake:
    def __init__(self, opts: WorkerOptions, instance: str, batches: Batches, dispatcher: Dispatcher, shares: Shares,
                 models: ModelGate, pace: IdlePace) -> None:
        self.conn, self.sync_conn, self.opts, self.instance = batches.conn, batches.sync_conn, opts, instance
        self.batches, self.held = batches, batches.held  # loads what is taken
        self.dispatcher, self.shares = dispatcher, shares  # whether the engine takes new work; priorities
        self.models = models  # which jobs this engine's server may run (worker/watch.py)
        self.queued = pace.queued  # set by the wake listener when batches are queued
        self.exhausted = False  # the last look at the queue found nothing for this engine (--burst: leave?)
        self.foreign: set[str] = set()  # jobs of a model this engine's server does not serve
        self._foreign_at = float("-inf")
        self._take = self.conn.register_script(scripts.TAKE)
        self._rq = rq_worker(self.sync_conn, instance)

    def wants_batch(self) -> bool:
        if not self.dispatcher.accepting():
            return False
        base, held = self.opts.loops, len(self.held)
        if held < base:
            return True
        if held >= base + MAX_EXTRA:
            return False  # parked prompts are not work: no more batches for them
        if self.shares.head is not None and self.shares.wants_head(  # by_job() counts every waiting prompt
                self.dispatcher.todo.by_job(), max(1, self.dispatcher.controller.target // 2)):
            return True  # the queue's next batch outranks what waits here: not after a held batch's long tail
        # (prefetch - 1) batches' worth unsent, counted in prompts without an outcome and not in flight
        # (several held batches can be in their heavy tails at once).
        size = max((h.config.batch_size for h in self.held.values()), default=0)
        unsent = sum(len(h.unfinished) for h in self.held.values() if not h.dropped) - len(self.dispatcher.running)
        return unsent < (base - 1) * size

    async def run(self) -> None:
        # Redis away or refusing writes (full, a replica) at the start: waited out, as every write is.
        await retrying(lambda: asyncio.to_thread(self._rq_birth), "registering in rq info")
        beat_at = time.monotonic()
        quiet_since = time.monotonic()
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
                await self._wait(IDLE_POLL_S if idle else BUSY_POLL_S)
        finally:
            try:
                await asyncio.to_thread(self._rq.register_death)
            except (redis.RedisError, OSError):
                pass  # its key lapses within RQ_TTL_S

    async def take(self) -> bool:
        """TAKE one batch this engine may run, and load it; False if the queue has none. A TAKE whose
        answer was lost is sent again with the same token and answers the batch the first one took."""
        await retrying(self._refresh_foreign, "reading the jobs")
        token = uuid.uuid4().hex
        skip = sorted(self.foreign | self.batches.unwritten_jobs())
        script_keys, args = scripts.take_call(self.instance, token, _rq_now(), skip)
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
        if config is not None and (config := await self.models.admit(config)) is None:  # `auto` pinned
            self.foreign.add(ref.job)  # another model's job: back to the queue, and skipped from now on
            await self.batches.hand_back(ref, token)
            return
        await self.batches.load(token, ref, config)

    async def _refresh_foreign(self) -> None:
        """Jobs whose model is pinned to one this server does not serve."""
        if time.monotonic() - self._foreign_at < FOREIGN_EVERY_S:
            return
        model = self.dispatcher.watch.model
        jobs = sorted(await job_names(self.conn))
        foreign = {job: now.config.model for job, now in zip(jobs, await jobs_now(self.conn, jobs))
                   if now.config is not None and now.config.model != AUTO and not serves(now.config.model, model)}
        self.foreign = set(foreign)
        self._foreign_at = time.monotonic()
        for job, job_model in foreign.items():
            await self.models.refuse(job, job_model)

    def _rq_birth(self) -> None:
        try:
            self._rq.register_birth()
        except ValueError:  # "an active worker named ..." : a try before this one got that far
            pass
        self._rq_beat()

    def _rq_beat(self) -> None:
        self._rq.set_state("busy" if self.held else "idle")
        self._rq.heartbeat(RQ_TTL_S)

    async def _wait(self, seconds: float) -> None:
        await wait_event(self.queued, seconds)
        self.queued.clear()


def _rq_now() -> str:
    """Now as RQ writes its timestamps (rq.utils.utcformat)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
