"""A job is for one model: which jobs this engine's server can serve, and `--model auto`.

`auto` is resolved by the first engine that takes one of the job's batches: its server's model is
written into the job's settings (first writer wins) and every engine reads it there. An engine
whose server serves another model leaves such a job's batches queued (TAKE's skip list), hands back
one it got anyway, and steals none of its prompts, and says so once per job.
"""

from __future__ import annotations

import logging

import redis
import redis.asyncio as aioredis

from genq.core.ledger import jobs as ledger_jobs
from genq.core.records import JobConfig
from genq.worker.watch import ServerWatch

log = logging.getLogger("genq.worker")

AUTO = "auto"


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
    config, pinned = await ledger_jobs.pin_model(conn, job, model, AUTO)
    if pinned:
        log.info("job %s: --model auto resolved to %s, the model of the first server that took it; "
                 "pinned in its settings", job, model)
    return config


class ModelGate:
    """This engine's side: pins `auto` jobs and turns away other models' jobs."""

    def __init__(self, conn: aioredis.Redis, instance: str, watch: ServerWatch) -> None:
        self.conn = conn
        self.instance = instance
        self.watch = watch  # the model its server serves
        self._told: set[str] = set()  # jobs whose refusal was logged

    async def admit(self, config: JobConfig) -> JobConfig | None:
        """The job's settings to run it with (`auto` pinned to this server's model), or None
        when it is another model's job."""
        model = self.watch.model
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
        if job not in self._told:
            self._told.add(job)
            log.warning(_refusal(job, job_model, self.watch.model))

    async def servable_config(self, job: str) -> JobConfig | None:
        """The job's settings now if this engine may take its prompts (the stealer's view), else None.
        An `auto` job is not pinned here: its batches' holders have pinned it already."""
        found = (await ledger_jobs.jobs_now(self.conn, [job]))[0].config
        if found is None or not serves(found.model, self.watch.model):
            if found is not None:
                await self.refuse(job, found.model)
            return None
        return found


def servable_jobs(conn: redis.Redis, model: str | None, jobs: list[str]) -> list[str]:
    """Of these jobs, those a server serving `model` may run (for `genq workers`)."""
    if not jobs:
        return []
    return [job for job, config in zip(jobs, [n.config for n in ledger_jobs.jobs_now(conn, jobs)], strict=True)
            if config is not None and serves(config.model, model)]
