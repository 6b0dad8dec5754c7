"""An engine's side of priorities and fair share (docs/scheduling.md, genq.core.order).

Which held prompts are claimed next (worker/claims.py Backlog.claim asks `plan`): the highest
priority first, as many as it has waiting; among jobs of equal priority, in turns weighted by
each job's weight, counted over the engine's life (a job that joins starts CATCH_UP prompts behind
the most served, no further: it gets a little more than its share at first, for what it lost while
its batch was on its way, not the whole window until it caught up). Nothing in flight is
stopped: slots move over as requests finish.

Every second while it holds anything, the engine reads the schedules of the jobs it holds and
what the queue's next batch is (`head`): RqLoops takes one more batch when that is of a job with
higher priority than any it has waiting, or of equal priority and a job it has nothing of waiting.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis
import redis.asyncio as aioredis

from genq.core import keys, scripts
from genq.core.order import batch_of_description, schedule_of
from genq.core.records import JobSchedule

log = logging.getLogger("genq.worker")

REFRESH_EVERY_S = 1.0
# Prompts a job that joins, or had nothing waiting here a while, may claim ahead of its turn:
# about what it lost while its batch was on its way (a new RQ loop starting, the lease).
CATCH_UP = 32


class Shares:
    def __init__(self, conn: aioredis.Redis, queue_key: str, jobs: Callable[[], set[str]]) -> None:
        self.conn = conn
        self.queue_key = queue_key
        self.jobs = jobs  # the jobs this engine holds or borrows prompts of now
        self.sched: dict[str, JobSchedule] = {}
        self.head: str | None = None  # the job of the queue's next batch (None: empty, or not read)
        self.served: dict[str, float] = {}  # prompts claimed per job, over its weight
        self._head = conn.register_script(scripts.QUEUE_HEAD)

    def priority(self, job: str) -> int:
        return self.sched.get(job, JobSchedule()).priority

    def weight(self, job: str) -> float:
        return self.sched.get(job, JobSchedule()).weight

    async def run(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_EVERY_S)
            jobs = sorted(self.jobs())
            if not jobs:
                self.head = None
                continue  # idle: nothing read (worker/idle.py)
            try:
                await self.refresh(jobs)
            except (redis.RedisError, OSError) as exc:
                log.debug("schedules not read: %s", exc)

    async def refresh(self, jobs: list[str]) -> None:
        async with self.conn.pipeline(transaction=False) as pipe:
            pipe.mget([keys.job_schedule(j) for j in jobs])
            script_keys, args = scripts.queue_head_call(self.queue_key)
            await self._head(keys=script_keys, args=args, client=pipe)
            raws, head = await pipe.execute()
        self.sched.update({job: schedule_of(raw) for job, raw in zip(jobs, raws)})
        found = batch_of_description(head)
        self.head = found[0] if found else None
        if self.head is not None and self.head not in self.sched:
            self.sched[self.head] = schedule_of(await self.conn.get(keys.job_schedule(self.head)))

    def wants_head(self, waiting: dict[str, int], low: int = 1) -> bool:
        """Whether the queue's next batch should be taken now although every loop holds one:
        it is of higher priority than anything waiting here, or of equal priority and a job with
        fewer than `low` prompts waiting here. Taken only once a job had run dry, its next batch
        arrived after a gap in which the other jobs took every slot that freed (the second of two
        equal jobs started 38% of the prompts, tests/test_scheduling.py)."""
        if self.head is None:
            return False
        if not waiting:
            return False  # the ordinary rule (worker/loops.py) takes more when little is waiting
        best = max(self.priority(j) for j in waiting)
        head = self.priority(self.head)
        return head > best or (head == best and waiting.get(self.head, 0) < low)

    def plan(self, waiting: dict[str, int], n: int) -> list[tuple[str, int]]:
        """How many of n claims go to each job with prompts waiting, in the order to claim them."""
        out: dict[str, int] = {}
        for priority in sorted({self.priority(j) for j in waiting}, reverse=True):
            if n <= 0:
                break
            level = [j for j in waiting if self.priority(j) == priority and waiting[j] > 0]
            top = max((self.served[j] for j in level if j in self.served), default=0.0)
            for job in level:  # a job that joins, or comes back, catches up at most CATCH_UP prompts
                self.served[job] = max(self.served.get(job, top - CATCH_UP), top - CATCH_UP)
            left = dict((j, waiting[j]) for j in level)
            while n > 0 and left:
                job = min(left, key=lambda j: (self.served[j], j))
                out[job] = out.get(job, 0) + 1
                self.served[job] += 1 / self.weight(job)
                n -= 1
                left[job] -= 1
                if not left[job]:
                    del left[job]
        if len(self.served) > 256:  # jobs long gone
            self.served = {j: v for j, v in self.served.items() if j in waiting}
        return list(out.items())
