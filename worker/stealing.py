"""The end of a job on a fleet: an engine with idle slots takes unsent prompts of batches other
engines hold.

Only once RQ's queue is empty: an engine with free slots claims (worker/claims.py) up to that many
from the back of another engine's batch while its holder sends from the front, so every free slot
takes the next prompt as from one shared queue; claims of an engine that stopped beating are taken
too. The prompts are "borrowed": sent and recorded here; the holder writes the shard.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import redis
import redis.asyncio as aioredis

from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger import leasing
from genq.core.records import BatchRef, BatchSource, JobConfig, Prompt, unpack
from genq.core.words import plural
from genq.ops.written import adopt_if_written
from genq.producer.batchinput import load_prompts
from genq.worker.batches import Batches
from genq.worker.claims import Claims
from genq.worker.controller import ConcurrencyController
from genq.worker.controls import Controls
from genq.worker.dispatch import Dispatcher
from genq.worker.held import HeldBatch, Holdings
from genq.worker.idle import IdlePace
from genq.worker.intake import Intake

log = logging.getLogger("genq.worker")

STEAL_EVERY_S = 0.5  # while the queue has batches: a look at its length (one LLEN)
STEAL_AGAIN_S = 0.1  # after a take, or while every slot is busy: a freed slot waits at most this
STEAL_IDLE_MAX_S = 2.0  # the longest wait between looks while there is nothing to take
BATCHES_CACHED = 64


class Stealer:
    def __init__(self, conn: aioredis.Redis, queue_key: str, instance: str, controls: Controls, intake: Intake,
                 held: Holdings,
                 dispatcher: Dispatcher, controller: ConcurrencyController, claims: Claims, batches: Batches,
                 job_config: Callable[[str], Awaitable[JobConfig | None]], pace: IdlePace) -> None:
        self.conn = conn
        self.queue_key = queue_key
        self.instance = instance
        self.controls = controls
        self.intake = intake  # whether the engine takes new work now
        self.held = held
        self.dispatcher = dispatcher
        self.controller = controller
        self.claims = claims
        self.batches = batches  # borrowed prompts go back through their holder's Batches
        self.taken = 0  # prompts taken since start
        # Prompts of batches looked at, by batch and job incarnation: a job deleted and enqueued
        # again under its name numbers its batches from b0000001 again, with other prompts.
        self._batches: OrderedDict[tuple[BatchRef, str], list[Prompt] | None] = OrderedDict()
        self.job_config = job_config  # the job's settings if this engine may take its prompts (worker/models.py)
        self.pace = pace  # the engine's idleness: an idle stealer naps (worker/idle.py)

    async def run(self) -> None:
        wait = STEAL_EVERY_S
        while True:
            woken = await self.pace.nap(wait)  # idle: until woken, or IDLE_LOOK_S
            if woken and not self.controls.leases_fresh():
                await self.pace.fresh_beat(lambda: self.controls.last_beat)  # idle: its last lease check is old
            try:
                took = await self.pass_once()
            except (redis.RedisError, OSError) as exc:
                log.debug("stealing skipped: %s", exc)
                took = 0
            # Soon again after a take or while the slots are full; while nothing is found, less often.
            wait = (STEAL_AGAIN_S if took or self.free_slots() <= 0 else STEAL_EVERY_S if took is None
                    else min(wait * 2, STEAL_IDLE_MAX_S))

    def free_slots(self) -> int:
        d = self.dispatcher
        return self.controller.target - d.running.sequences - d.unsent

    async def pass_once(self) -> int | None:
        """Take up to the free slots' worth of prompts; how many were taken (None: not looked,
        the queue has batches)."""
        self._forget_finished()
        if self.dispatcher.watch.down and self.held.borrowed:
            await self.batches.give_back_borrowed("this worker's server is down")  # the holders need not wait for it
            return 0
        free = self.free_slots()
        if free <= 0 or not self.intake.accepting() or self.dispatcher.hold_back or not self.controls.leases_fresh():
            return 0
        if await self.conn.llen(self.queue_key):
            return None  # RQ hands the queue's batches out: the end of the job is not here yet
        took = 0
        unwritten = self.batches.completer.unwritten_jobs()
        for ref, holder, config in await self._leased_elsewhere():
            if ref.job in unwritten:
                continue  # its shards cannot be written here now (worker/completion.py)
            if await self.job_config(ref.job) is None:
                continue  # another model's job (worker/models.py)
            prompts = await self._batch(ref, config)
            if prompts is None:
                continue
            ids = await self.claims.steal(ref, config.incarnation, holder, [p.id for p in reversed(prompts)], free)
            if not ids:
                continue
            if await adopt_if_written(self.conn, config, ref):  # written already: Redis lost that
                continue
            if ref in self.held:  # leased to this engine meanwhile: its own lease sends them
                await self.claims.unclaim(self.held[ref], ids)
                continue
            took += len(ids)
            free -= len(ids)
            self._lend_here(ref, config, prompts, ids)
            if free <= 0:
                break
        if took:
            self.taken += took
        return took

    def _lend_here(self, ref: BatchRef, config: JobConfig, prompts: list[Prompt], ids: dict[str, int]) -> None:
        borrowed = self.held.borrowed.get(ref)
        if borrowed is not None and borrowed.config.incarnation != config.incarnation:
            self.dispatcher.drop(borrowed, cancel=True)  # of a deleted job: nothing of it is recorded
        if borrowed is None or borrowed.dropped:
            borrowed = self.held.borrowed[ref] = HeldBatch(ref, token="", config=config, size=len(prompts),
                                                      unfinished=set(), borrowed=True)
        borrowed.unfinished |= set(ids)
        log.info("took %s of batch %s from another worker", plural(len(ids), "unsent prompt"), ref)
        self.dispatcher.todo.add_claimed(borrowed, [p for p in prompts if p.id in ids], ids)

    async def _leased_elsewhere(self) -> list[tuple[BatchRef, str, JobConfig]]:
        """Batches other engines hold, with their job's settings as they are now (read each pass:
        a job deleted and enqueued again under its name is another incarnation)."""
        names = [j for j in await ledger_jobs.job_names(self.conn) if j not in self.controls.paused_jobs]
        out = []
        for job, now in zip(names, await ledger_jobs.jobs_now(self.conn, names, leases=True)):
            if now.config is None:
                continue
            config = now.config
            for batch, holder in now.leases.items():
                ref = BatchRef(job, batch)
                if holder and holder != self.instance and ref not in self.held:
                    out.append((ref, holder, config))
        return await self._by_priority(out)

    async def _by_priority(self, found: list[tuple[BatchRef, str, JobConfig]]) -> list[tuple[BatchRef, str, JobConfig]]:
        """The highest priority first, paused jobs left out (their holders park them), holders mixed
        (idle engines spread over them). Read only for jobs with batches to take: an idle fleet reads nothing."""
        names = sorted({ref.job for ref, _, _ in found})
        if not names:
            return []
        priority = {job: now.schedule.priority for job, now in zip(names, await ledger_jobs.jobs_now(self.conn, names))
                    if not now.paused}
        out = [f for f in found if f[0].job in priority]
        random.shuffle(out)
        out.sort(key=lambda f: -priority[f[0].job])  # docs/scheduling.md
        return out

    async def _batch(self, ref: BatchRef, config: JobConfig) -> list[Prompt] | None:
        cached = (ref, config.incarnation)
        if cached not in self._batches:
            raw = await leasing.batch_record(self.conn, ref)
            loaded = None
            if raw is not None:
                try:
                    loaded = await load_prompts(unpack(raw, BatchSource), config)
                except Exception as exc:  # unreadable or changed input: its holder deals with it
                    log.debug("not taking from batch %s: its input cannot be read (%s)", ref, exc)
            self._batches[cached] = loaded
            while len(self._batches) > BATCHES_CACHED:
                self._batches.popitem(last=False)
        return self._batches[cached]

    def forget_batches(self, job: str) -> None:
        """The job's settings changed (worker/parking.py): batches cached with the old ones go."""
        for cached in [c for c in self._batches if c[0].job == job]:
            self._batches.pop(cached)

    # ---------------------------------------------------------------- borrowed prompts

    def _forget_finished(self) -> None:
        for ref in [r for r, b in self.held.borrowed.items() if not b.unfinished or b.dropped]:
            self.held.borrowed.pop(ref)
