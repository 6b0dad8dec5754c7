"""Whether a job's prompts may be sent here: the operator's controls, the brake, parking.

`Controls`: what the heartbeat last read (drain, pause of all or of jobs, a live concurrency cap) and
when it last checked the leases; the heartbeat alone writes them, every other part reads them.

`Brake`: a job whose requests keep failing the same way stops; its prompts wait. A wrong setting
(max_tokens over the context) fails every request of a job with the same 400; dead-lettering them one
by one would burn the whole job. So each engine keeps a job's last WINDOW outcomes (a result, or a
non-retryable failure under its signature: status and message with the numbers blanked) and holds a
failure back while its signature is most of the window. A full window mostly one signature, from at
least TRIP_PROMPTS prompts, trips: the job is blocked and the held prompts stay unfinished for a resume.
Otherwise held failures are dead-lettered once other outcomes outnumber them, or after HOLD_S.

`Parking`: a blocked job (the brake, the preflight) is a paused job with a reason: keys.job_paused and
keys.job_blocked (a JobBlock). Every engine that holds its batches **parks** them: it stops sending,
cancels their requests in flight (nothing is recorded for them), drops its claims, and ends the lease
with no RQ job carrying the batch (the ledger's reconciler leaves a blocked job alone). A batch of the
job that arrives later is parked the same way before anything is sent; a paused job's requests in
flight finish first. `genq resume --job JOB` (genq.ops.control) queues the parked batches again.
Settings fixed in place (`genq jobs set`, a new settings_version) reach the batches held within a
second, and every batch that arrives is checked against the stored version. The preflight blocks a
job whose settings can never fit its server before any request: a prompt has at least one token, so
max_tokens at or over the context never fits (SGLang answers every request 400, vLLM too over the
context, llama.cpp cuts every completion at its slot's end). docs/settings.md.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter, deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis

from genq.core.ledger import fleet
from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger.leasing import unqueue
from genq.core.records import JobBlock, JobConfig, Prompt
from genq.core.timings import LEASE_CHECK_STALE_S
from genq.core.waits import retrying, wait_event
from genq.core.words import plural
from genq.worker.batches import Batches
from genq.worker.controller import ConcurrencyController
from genq.worker.held import HeldBatch, Task
from genq.worker.server import Failure, ServerInfo
from genq.worker.watch import ServerWatch

log = logging.getLogger("genq.worker")

class Controls:
    def __init__(self, conn: aioredis.Redis, name: str, controller: ConcurrencyController) -> None:
        self.conn = conn
        self.name = name
        self.controller = controller
        self.paused_all = False
        self.paused_jobs: set[str] = set()
        self.draining = False
        # When the heartbeat last checked the leases (monotonic): a longer gap than a lease survives
        # (a frozen process) stops dispatch until they are checked again.
        self.last_beat = time.monotonic()

    def leases_fresh(self) -> bool:
        """The leases were checked recently enough to send on them."""
        return time.monotonic() - self.last_beat < LEASE_CHECK_STALE_S

    def leases_checked(self) -> None:
        self.last_beat = time.monotonic()

    async def read(self, jobs: list[str]) -> bool:
        """Applies the operator's controls for these jobs; True if one changed."""
        control, paused, paused_jobs = await fleet.read_controls(self.conn, self.name, jobs)
        changed = False
        if control.drain and not self.draining:
            log.info("drain requested: finishing held batches, taking no new ones")
            self.draining = changed = True
        if (control.concurrency or None) != self.controller.live_cap:
            self.controller.set_cap(control.concurrency)
            log.info("concurrency cap now %s (target %d)", control.concurrency or "auto", self.controller.target)
            changed = True
        if paused != self.paused_all or paused_jobs != self.paused_jobs:
            _log_pause_change(self.paused_all, self.paused_jobs, paused, paused_jobs)
            self.paused_all, self.paused_jobs = paused, paused_jobs
            changed = True
        return changed


def _log_pause_change(was_all: bool, was: set[str], now_all: bool, now: set[str]) -> None:
    """Says what the operator changed since the last read: "paused: a" and "resumed: a" (not the
    whole set: an empty one read as "none"). A paused job's batches stay parked here until `genq
    resume` queues them again, so a job that leaves the set read was resumed (or deleted)."""
    if now_all != was_all:
        log.info("%s all jobs", "paused:" if now_all else "resumed:")
    if now - was:
        log.info("paused: %s", ", ".join(sorted(now - was)))
    if was - now:
        log.info("resumed: %s", ", ".join(sorted(was - now)))


WINDOW = 24  # a job's recent outcomes on one engine that the brake looks at
TRIP_PROMPTS = 8  # different prompts failing the same way before a job is blocked
HOLD_S = 5.0  # longest a held failure waits for its verdict (the last prompts of a job)

_NUMBER = re.compile(r"\d+")


def signature(failure: Failure) -> str:
    """What makes two failures "the same answer": the status and the message, numbers aside."""
    return f"{failure.status} {_NUMBER.sub('N', failure.message)}"


@dataclass
class _Held:
    task: Task
    failure: Failure
    signature: str
    since: float


@dataclass
class JobWindow:
    """One job's recent outcomes on this engine: (signature, or None for a result; prompt id)."""

    outcomes: deque[tuple[str | None, str]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    held: list[_Held] = field(default_factory=list)


class Brake:
    """Judges each job's outcomes on this engine; `batches.dead(task, failure)` dead-letters a prompt. A
    trip adds the job's block to `trips` and sets `tripped`: parking stores it and parks the job. The job
    counts as blocked here until `clear`."""

    def __init__(self, worker: str, batches: Batches) -> None:
        self.worker = worker
        self.batches = batches
        self.windows: dict[str, JobWindow] = {}
        self.blocked: set[str] = set()  # jobs blocked as far as this engine knows
        self.trips: dict[str, JobBlock] = {}  # blocks tripped here, not yet taken by parking
        self.tripped = asyncio.Event()

    def succeeded(self, task: Task) -> None:
        job = task.batch.ref.job
        window = self.windows.get(job)
        if window is None:
            window = self.windows[job] = JobWindow()
        window.outcomes.append((None, task.prompt.id))
        if window.held:
            self.judge(job)

    def failed(self, task: Task, failure: Failure) -> bool:
        """A non-retryable failure: True if the brake takes it (held, or its job is blocked:
        the prompt stays unfinished), False to dead-letter it now."""
        job = task.batch.ref.job
        if job in self.blocked:
            return True  # the job's batches are being parked: this prompt waits with them
        if not task.batch.config.brake:
            return False  # `genq jobs set JOB --no-brake`: every failing prompt is its own
        window = self.windows.setdefault(job, JobWindow())
        sig = signature(failure)
        window.outcomes.append((sig, task.prompt.id))
        window.held.append(_Held(task, failure, sig, time.monotonic()))
        self.judge(job)
        return True

    def judge(self, job: str) -> None:
        """Trip, or let go of the held failures that are no longer most of the window."""
        window = self.windows.get(job)
        if window is None or job in self.blocked:
            return
        counts = Counter(sig for sig, _ in window.outcomes if sig is not None)
        n = len(window.outcomes)
        if counts:
            sig, failures = counts.most_common(1)[0]
            prompts = {pid for s, pid in window.outcomes if s == sig}
            if n >= WINDOW and len(prompts) >= TRIP_PROMPTS and 2 * failures > n:
                self._trip(job, window, sig, failures, n, len(prompts))
                return
        now = time.monotonic()
        keep = []
        for held in window.held:
            if 2 * counts.get(held.signature, 0) > n and now - held.since < HOLD_S:
                keep.append(held)
            else:
                self.batches.dead(held.task, held.failure)
        window.held = keep

    def judge_all(self) -> None:
        """Held failures past HOLD_S go to the dead-letter queue (called about once a second)."""
        for job in [j for j, w in self.windows.items() if w.held]:
            self.judge(job)

    def _trip(self, job: str, window: JobWindow, sig: str, failures: int, n: int, prompts: int) -> None:
        example = next(h for h in window.held if h.signature == sig)
        kept = len(window.held)
        window.held = []  # not dead-lettered: they stay unfinished, queued with the rest of the job
        self.blocked.add(job)
        record = JobBlock(reason="brake", message=example.failure.message, worker=self.worker, at=time.time(),
                          settings_version=example.task.batch.config.settings_version,
                          status=example.failure.status, failures=failures, outcomes=n, prompts=prompts)
        log.error("job %s blocked by the brake: %d of its last %d requests here failed the same way across %d "
                  "prompts (%s%s: %s); its prompts stay queued (%d held back from the dead-letter queue). "
                  "Fix the settings (genq jobs set %s ...), then genq resume --job %s",
                  job, failures, n, prompts, example.failure.kind,
                  f" {example.failure.status}" if example.failure.status else "", example.failure.message,
                  kept, job, job)
        self.trips[job] = record
        self.tripped.set()

    def clear(self, job: str) -> None:
        """The job runs again (resumed): its old outcomes are no evidence."""
        self.blocked.discard(job)
        self.reset(job)

    def reset(self, job: str) -> None:
        """New settings: outcomes under the old ones are no evidence."""
        window = self.windows.pop(job, None)
        if window is not None:
            for held in window.held:  # judged under the old settings: dead-lettered as they would have been
                self.batches.dead(held.task, held.failure)


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
    def __init__(self, batches: Batches, controls: Controls, brake: Brake, watch: ServerWatch) -> None:
        self.conn = batches.conn
        self.sync_conn = batches.sync_conn
        self.worker = batches.worker
        self.held = batches.held
        self.batches = batches  # admitted batches are sent, parked ones let go, by their owner
        self.controls = controls  # the operator's pauses
        self.brake = brake  # its trips block their job here
        self.watch = watch  # what the server says about itself (its context, for the preflight)
        # When this engine's block of a job landed in Redis (inf while it is stored): a read asked
        # before says nothing of a lift.
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
        (now,) = await retrying(lambda: ledger_jobs.jobs_now(self.conn, [job]), f"checking job {job}")
        blocked, config, paused = now.blocked, now.config, now.paused
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
            await retrying(lambda: ledger_jobs.block_job(self.conn, job, record), f"blocking job {job}")
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
        for job, now in zip(jobs, await ledger_jobs.jobs_now(self.conn, jobs)):
            config = now.config
            if now.blocked:
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
