"""What an engine does with a blocked job, and with a job whose settings changed.

A blocked job (worker/brake.py, the preflight below) is a paused job with a reason:
keys.job_paused and keys.job_blocked (a JobBlock). Every engine that holds its batches
**parks** them: it stops sending, cancels their requests in flight (nothing is recorded for
them), drops its claims, and ends the lease with no RQ job carrying the batch (keys.job_leases
and keys.job_transport lose their entries; the ledger's reconciler leaves a blocked job alone).
A batch of the job that arrives later is parked the same way before anything is sent. Their
prompts are neither sent nor dead-lettered: `genq resume --job JOB` (genq.ops.control) queues
the parked batches again.

Settings fixed in place (`genq jobs set`, a new JobConfig.settings_version) reach the batches an
engine holds within a second, and every batch that arrives is checked against the stored version.

The preflight blocks a job whose settings can never fit its server before any request: a prompt
has at least one token, so max_tokens at or over the context never fits (SGLang answers every
request 400, vLLM too over the context, llama.cpp cuts every completion at its slot's end).
Below the context a too-long prompt is its own failure: the brake's case (worker/brake.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

import redis
import redis.asyncio as aioredis

from genq.core.ledger import holding
from genq.core.records import JobBlock, JobConfig, Prompt
from genq.core.waits import retrying, wait_event
from genq.core.words import plural
from genq.ops.settings import unqueue
from genq.worker.batches import Batches
from genq.worker.brake import Brake
from genq.worker.controls import Controls
from genq.worker.held import HeldBatch, Holdings
from genq.worker.server import ServerInfo
from genq.worker.stealing import Stealer
from genq.worker.watch import ServerWatch

log = logging.getLogger("genq.worker")

CHECK_EVERY_S = 1.0


def preflight(config: JobConfig, server: ServerInfo | None) -> str | None:
    """Why `config` can never work against `server` (its context: worker/engines.py), or None."""
    if server is None or not server.context_length:
        return None  # the server says nothing about its context: the brake is the safeguard
    context = server.context_length
    if config.max_tokens < context:
        return None
    return (f"max_tokens {config.max_tokens} (settings version {config.settings_version}) is not below "
            f"{server.engine.context_where} of {context} tokens on this {server.flavor} server: no prompt can fit "
            f"(prompt + max_tokens must fit in the context). Lower it with `genq jobs set {config.name} "
            f"--max-tokens N` (N < {context}), then `genq resume --job {config.name}`.")


class Parking:
    def __init__(self, conn: aioredis.Redis, sync_conn: redis.Redis, worker: str, controls: Controls, held: Holdings,
                 batches: Batches, brake: Brake, stealer: Stealer, watch: ServerWatch) -> None:
        self.conn = conn
        self.sync_conn = sync_conn
        self.worker = worker
        self.controls = controls  # the operator's pauses
        self.held = held
        self.batches = batches  # admitted batches are sent, parked ones let go, by their owner
        self.brake = brake  # the dispatcher's: its trips block their job here
        self.stealer = stealer  # its cache of other engines' batches goes with old settings
        self.watch = watch  # what the server says about itself (its context, for the preflight)
        self.parked = 0  # batches parked since start
        # When this engine's block of a job landed in Redis (inf while it is stored): a read asked
        # before says nothing of a lift. (A guess of 3 s re-parked a batch a resume queued at once.)
        self._landed_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.pausing: set[str] = set()  # paused jobs being parked here (park_paused)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("blocked-job handling failed", exc_info=task.exception())

    # ---------------------------------------------------------------- arriving batches

    async def admit(self) -> None:
        """Each loaded batch (Batches.arrived) is sent only if its job is not blocked or paused, with
        the job's current settings, and past the preflight."""
        while True:
            held, prompts = await self.batches.arrived.get()
            self._spawn(self._admit(held, prompts))

    async def _admit(self, held: HeldBatch, prompts: list[Prompt]) -> None:
        job = held.ref.job

        asked = time.monotonic()
        blocked, config, paused = await retrying(lambda: holding.arrival_state(self.conn, job), f"checking job {job}")
        if config is not None:
            self._settings(job, config)
        if blocked:
            self._blocked_elsewhere(job)
        elif self._lifted(job, asked):
            self._resumed(job)
        if held.dropped or held.ref not in self.held:
            return  # handed back meanwhile (stopping)
        if job in self.brake.blocked:
            await self.park_job(job, quiet=True)
            return
        if paused:  # `genq pause --job`: parked, its slots go to other jobs
            await self.park_job(job, quiet=True, cancel=False)
            return
        problem = preflight(held.config, self.watch.info)
        if problem is not None:  # judged by what the server says now, not before a restart
            problem = preflight(held.config, await self.watch.reread())
        if problem is not None:
            log.error("job %s blocked before any request (preflight): %s", job, problem)
            self.block(job, JobBlock(reason="preflight", message=problem, worker=self.worker, at=time.time(),
                                     settings_version=held.config.settings_version))
            return
        self.batches.send(held, prompts)

    # ---------------------------------------------------------------- blocking

    def block(self, job: str, record: JobBlock) -> None:
        """Block `job` (the first reason stored wins) and park what this engine holds of it."""
        self.brake.blocked.add(job)
        self._landed_at[job] = float("inf")
        self._spawn(self._block(job, record))

    async def _block(self, job: str, record: JobBlock) -> None:
        try:
            await retrying(lambda: holding.block_job(self.conn, job, record), f"blocking job {job}")
        finally:
            self._landed_at[job] = time.monotonic()
        await self.park_job(job)
        try:
            taken = await asyncio.to_thread(unqueue, self.sync_conn, job)
        except (redis.RedisError, OSError) as exc:  # they are parked one by one as they arrive instead
            log.warning("job %s: could not take its batches out of RQ's queue (%s)", job, exc)
        else:
            if taken:
                log.info("job %s: %d of its batches taken out of RQ's queue, parked until `genq resume --job %s`",
                         job, taken, job)

    def _blocked_elsewhere(self, job: str) -> None:
        if job not in self.brake.blocked:
            log.warning("job %s is blocked (genq jobs show %s): parking its batches here", job, job)
            self.brake.blocked.add(job)
            self._spawn(self.park_job(job))

    def _lifted(self, job: str, asked: float) -> bool:
        """Redis, read at `asked`, says `job` is not blocked, and that is news (not a read from before
        our own block landed)."""
        return job in self.brake.blocked and job not in self.brake.trips and asked > self._landed_at.get(job, float("-inf"))

    def _resumed(self, job: str) -> None:
        log.info("job %s is no longer blocked: taking its batches again", job)
        self.brake.clear(job)

    async def park_job(self, job: str, *, quiet: bool = False, cancel: bool = True) -> None:
        """Park what this engine holds of the job (Batches.park): blocked, its requests in flight are
        cancelled; paused (`cancel` False), they finish and are recorded."""
        parked = await self.batches.park(job, cancel=cancel)
        self.parked += len(parked)
        if parked:
            (log.debug if quiet else log.info)(
                "job %s is %s: parked %s (%s); their prompts wait for `genq resume --job %s`",
                job, "blocked" if cancel else "paused", plural(len(parked), "batch", "batches"), ", ".join(parked), job)

    # ---------------------------------------------------------------- settings and pauses, every second

    def _settings(self, job: str, stored: JobConfig) -> None:
        """A newer settings version of a job this engine holds: every unsent prompt gets it."""
        batches = [h for h in self.held.values() if h.ref.job == job]
        batches += [b for ref, b in self.held.borrowed.items() if ref.job == job]
        stale = [h for h in batches if h.config.incarnation == stored.incarnation
                 and h.config.settings_version < stored.settings_version]
        if not stale:
            return
        self.stealer.forget_batches(job)
        for h in stale:
            h.config = stored
        self.brake.reset(job)
        log.info("job %s: settings version %d from now on (%s held here)", job, stored.settings_version,
                 plural(len(stale), "batch", "batches"))
        problem = preflight(stored, self.watch.info)
        if problem is not None and job not in self.brake.blocked:
            log.error("job %s blocked (preflight of its new settings): %s", job, problem)
            self.block(job, JobBlock(reason="preflight", message=problem, worker=self.worker, at=time.time(),
                                     settings_version=stored.settings_version))

    async def run(self) -> None:
        while True:
            await wait_event(self.brake.tripped, CHECK_EVERY_S)
            self.brake.tripped.clear()
            for job, record in self.brake.trips.items():
                self.block(job, record)
            self.brake.trips.clear()
            try:
                await self.check()
            except (redis.RedisError, OSError) as exc:
                log.debug("blocked/settings check skipped: %s", exc)
            self.brake.judge_all()

    async def check(self) -> None:
        self.park_paused()
        jobs = sorted(self.held.all_jobs() | self.brake.blocked)
        if not jobs:
            return
        asked = time.monotonic()
        for job, (blocked, config) in zip(jobs, await holding.blocks_and_configs(self.conn, jobs)):
            if blocked:
                self._blocked_elsewhere(job)
            elif self._lifted(job, asked):
                self._resumed(job)
            if config is not None:
                self._settings(job, config)

    def park_paused(self) -> None:
        """Jobs paused (`genq pause --job`, read by the heartbeat) that this engine holds: parked once
        their requests in flight are done, so their slots go to other jobs at once (docs/scheduling.md)."""
        holding = self.held.all_jobs()
        for job in (self.controls.paused_jobs & holding) - self.brake.blocked - self.pausing:
            self.pausing.add(job)
            self._spawn(self._park_paused(job))

    async def _park_paused(self, job: str) -> None:
        try:
            await self.park_job(job, cancel=False)
        finally:
            self.pausing.discard(job)
