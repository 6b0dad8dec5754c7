"""A job is for one model: which jobs this engine's server can serve, and `--model auto`.

A job's model is its settings' `model`. `auto` is resolved by the first engine that takes one
of its batches: the model its server lists (/v1/models) is written into the job's settings
then, first writer wins (a WATCH/MULTI on the settings), and every engine reads it from there.

An engine whose server serves another model takes nothing of such a job:
- its RQ loops put the job's batches back at the tail of RQ's queue as they pop them, before
  any lease (worker/rqjob.py calls foreign_batch), and rest once they have gone
  round the whole queue without finding a batch of their own;
- its lease desk hands back a batch it got anyway (a race with the pinning);
- its stealer takes no prompts of it (servable_config).
It says so once per job in its log. One RQ queue serves every model: a fleet serving two
models runs two jobs at once, each on its own model's GPUs (docs/fidelity.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import redis
import redis.asyncio as aioredis

from genq.core import scripts
from genq.core.ledger import fleet, leasing
from genq.core.queueing import carried, load_config, load_configs
from genq.core.records import JobConfig

if TYPE_CHECKING:  # the types of what an RQ loop pops; RQ itself is the loop's (worker/rqjob.py)
    from rq import Queue
    from rq.job import Job

log = logging.getLogger("genq.worker")

AUTO = "auto"
# An RQ loop that has gone round the whole queue putting back other models' batches rests
# this long before the next round, doubling up to REST_MAX_S while it finds nothing of its own.
REST_MIN_S = 0.5
REST_MAX_S = 5.0
# How long an engine's published model lives without a heartbeat renewing it.
MODEL_TTL_S = 120
TOLD_TTL_S = 7 * 24 * 3600


def _refusal(job: str, job_model: str, server_model: str | None) -> str:
    return (f"job {job} is for model {job_model}; this worker's server serves {server_model}: "
            "it takes none of its batches or prompts")


def serves(job_model: str, server_model: str | None) -> bool:
    """Whether a server serving server_model may run a job for job_model. A server that lists
    no model cannot be told apart: it is trusted (and each record says what answered)."""
    return job_model == AUTO or server_model is None or job_model == server_model


async def pin_model(conn: aioredis.Redis, job: str, model: str) -> JobConfig | None:
    """The job's settings with `auto` resolved to `model`, unless another engine resolved it
    first (then its model stays). None if the job is gone."""
    config, pinned = await leasing.pin_model(conn, job, model, AUTO)
    if pinned:
        log.info("job %s: --model auto resolved to %s, the model of the first server that took it; "
                 "pinned in its settings", job, model)
    return config


class ModelGate:
    """This engine's side: pins `auto` jobs and turns away other models' jobs."""

    def __init__(self, conn: aioredis.Redis, instance: str, server_model: Callable[[], str | None]) -> None:
        self.conn = conn
        self.instance = instance
        self.server_model = server_model
        self._told: set[str] = set()  # jobs whose refusal was logged

    async def publish(self) -> None:
        """Tell this engine's RQ loops which model its server serves (again at each heartbeat)."""
        await fleet.publish_model(self.conn, self.instance, self.server_model(), MODEL_TTL_S)

    async def run(self) -> None:
        """Published again every MODEL_TTL_S / 4, and within a second of the server changing model
        (restarted with another: worker/watch.py), so the loops stop taking the old model's batches."""
        published: tuple[str | None, float] | None = None
        while True:
            model = self.server_model()
            if published is None or published[0] != model or time.monotonic() - published[1] > MODEL_TTL_S / 4:
                try:
                    await self.publish()
                    published = (model, time.monotonic())
                except (redis.RedisError, OSError) as exc:
                    log.debug("cannot publish the server's model: %s", exc)
            await asyncio.sleep(1.0)

    async def admit(self, config: JobConfig) -> JobConfig | None:
        """The job's settings to run it with (`auto` pinned to this server's model), or None
        when it is another model's job."""
        model = self.server_model()
        if config.model == AUTO and model is not None:
            pinned = await pin_model(self.conn, config.name, model)
            if pinned is None:
                return None
            config = pinned
        if serves(config.model, model):
            return config
        await self.refuse(config.name, config.model)
        return None

    async def refuse(self, job: str, job_model: str) -> None:
        if job in self._told:
            return
        self._told.add(job)
        if await fleet.first_refusal_async(self.conn, self.instance, job, TOLD_TTL_S):
            log.warning(_refusal(job, job_model, self.server_model()))

    async def servable_config(self, job: str, config: Callable[[str], Awaitable[JobConfig | None]]
                              ) -> JobConfig | None:
        """The job's settings if this engine may take its prompts (the stealer's view), else None.
        An `auto` job is not pinned here: its batches' holders have pinned it already."""
        found = await config(job)
        if found is None or not serves(found.model, self.server_model()):
            if found is not None:
                await self.refuse(job, found.model)
            return None
        return found


class LoopFilter:
    """An RQ loop's side (a child process): whether a popped batch is another model's."""

    def __init__(self, conn: redis.Redis, instance: str) -> None:
        self.conn = conn
        self.instance = instance
        self._models: dict[str, str] = {}  # job -> its pinned model (never changes once pinned)
        self._put_back = conn.register_script(scripts.PUT_BACK)
        self._told: set[str] = set()
        self._passed: set[str] = set()  # RQ jobs put back since this loop last took a batch
        self._rest = REST_MIN_S

    def foreign(self, job: str) -> bool:
        if fleet.unwritten_here(self.conn, self.instance, job):
            return True  # its shards cannot be written here now: left to other workers, or for later
        job_model = self._models.get(job)
        if job_model is None:
            config = load_config(self.conn, job)
            if config is None:
                return False  # gone: the engine sorts it out
            job_model = config.model
            if job_model != AUTO:
                self._models[job] = job_model
        if job_model == AUTO:
            return False  # the engine pins it when it takes the batch
        server = fleet.engine_model(self.conn, self.instance)
        if serves(job_model, server):
            return False
        if job not in self._told:
            self._told.add(job)
            if fleet.first_refusal(self.conn, self.instance, job, TOLD_TTL_S):
                log.warning(_refusal(job, job_model, server))
        return True


    def route(self, rq_job: Job, queue: Queue) -> float | None:
        """None for a popped batch to run; for another model's batch, put back at the queue's
        tail, the seconds to rest before the next pop."""
        if (batch := carried(rq_job)) is None or not self.foreign(batch[0]):
            self.took()
            return None
        return self.put_back(rq_job.id, queue.key, queue.intermediate_queue_key)

    def put_back(self, rq_id: str, queue_key: str, intermediate_key: str) -> float:
        """Return a popped batch of another model to the tail of the queue (out of RQ's
        intermediate list, in one step); how long to rest before the next pop."""
        script_keys, args = scripts.put_back_call(intermediate_key, queue_key, rq_id)
        self._put_back(keys=script_keys, args=args)
        if rq_id not in self._passed:
            self._passed.add(rq_id)
            return 0.0
        self._passed = {rq_id}  # round the whole queue: nothing here for this model now
        rest, self._rest = self._rest, min(REST_MAX_S, self._rest * 2)
        return rest

    def took(self) -> None:
        self._passed.clear()
        self._rest = REST_MIN_S


def servable_jobs(conn: redis.Redis, model: str | None, jobs: list[str]) -> list[str]:
    """Of these jobs, those a server serving `model` may run (for `genq workers`)."""
    if not jobs:
        return []
    return [job for job, config in zip(jobs, load_configs(conn, jobs), strict=True)
            if config is not None and serves(config.model, model)]
