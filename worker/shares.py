"""An engine's side of priorities and fair share (docs/scheduling.md): which held prompts are claimed
next (`plan`): the highest priority first; among equals, each claim to the job with the fewest claimed
or in flight on the whole fleet over its weight (per engine, a job held on one engine of two starved).
Every second while it holds anything, the engine publishes its counts per job, reads the others'
(FLEET_SHARE), the held jobs' schedules and the queue's next batch (for the intake's `wants_head`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter

import redis
import redis.asyncio as aioredis

from genq.core import scripts
from genq.core.ledger import jobs as ledger_jobs
from genq.core.queueing import batch_of_description
from genq.core.records import JobSchedule
from genq.worker.batches import Batches

log = logging.getLogger("genq.worker")

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
                continue  # idle: nothing read (worker/idle.py)
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

    def wants_head(self, waiting: dict[str, int], low: int = 1) -> bool:
        """Whether the queue's next batch should be taken now although --prefetch are held: it outranks
        what waits here, or ties it with fewer than `low` waiting (taken only once dry, the second of two
        equal jobs started 38% of the prompts, tests/test_scheduling.py)."""
        if self.head is None or not waiting:
            return False
        best = max(self.priority(j) for j in waiting)
        head = self.priority(self.head)
        return head > best or (head == best and waiting.get(self.head, 0) < low)

    def plan(self, waiting: dict[str, int], n: int) -> list[tuple[str, int]]:
        """How many of n claims go to each job with prompts waiting, in the order to claim them."""
        out: dict[str, int] = {}
        load = self._mine()
        for job, count in self.others.items():
            load[job] = load.get(job, 0) + count
        for priority in sorted({self.priority(j) for j in waiting}, reverse=True):
            left = {j: k for j, k in waiting.items() if self.priority(j) == priority and k > 0}
            while n > 0 and left:
                job = min(left, key=lambda j: (load.get(j, 0) / self.weight(j), j))
                out[job] = out.get(job, 0) + 1
                load[job] = load.get(job, 0) + 1
                n -= 1
                left[job] -= 1
                if not left[job]:
                    del left[job]
        return list(out.items())
