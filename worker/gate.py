"""Whether prompts may be sent here. The server (ServerWatch): down (a failed /health), another model or a smaller
context, nothing is sent, no attempt counted, polled until it answers as it was; after --server-down-timeout its
batches go back (another model: at once); `--model auto` is pinned to the first taker's server's. A job
(`Gate.why_not`): the operator's controls; the brake, which blocks a job whose requests keep failing the same way;
parking, which ends a blocked or paused job's leases with no RQ job until `genq resume --job` (docs/settings.md)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import redis

from genq.core.ledger import fleet
from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger.leasing import unqueue
from genq.core.records import JobBlock, JobConfig, Prompt
from genq.core.timings import LEASE_CHECK_STALE_S
from genq.core.waits import retrying
from genq.core.words import plural
from genq.ops.control import keep_pin
from genq.worker.batches import Batches
from genq.worker.controller import ConcurrencyController
from genq.worker.engines import Metrics
from genq.worker.held import HeldBatch, Task
from genq.worker.options import WorkerOptions
from genq.worker.server import Failure, ServerClient, ServerInfo, ServerUnavailable

log = logging.getLogger("genq.worker")

SILENT_PROBE_S = 15.0  # no output from any request in flight this long: ask /health
AUTO = "auto"


class Stopping(Protocol):
    """The engine's StopNow as the parts read it: 1 finish what is held, 2 stop now."""

    requested: int


class ServerStartTimeout(Exception):
    """The server did not answer within --server-start-timeout."""


class ServerWatch:
    """Whether the server is up (this watch alone decides); metrics for the controller; stalled requests cancelled."""

    def __init__(self, opts: WorkerOptions, client: ServerClient, controller: ConcurrencyController,
                 stopping: Stopping, batches: Batches) -> None:
        self.opts, self.client, self.controller, self.stopping = opts, client, controller, stopping
        self.conn, self.running, self.todo = batches.conn, batches.running, batches.todo  # in flight; unsent
        self._told: set[str] = set()  # jobs of another model whose refusal was logged
        self.info: ServerInfo | None = None
        self.metrics: Metrics | None = None
        self.down_since: float | None = None  # monotonic
        self.failing = False  # down because every request failed while /health answered: a request must succeed
        self.failed_at = 0.0  # when it was last taken as failing (monotonic): none answered since, it still is
        self.outages = 0  # since the start: a prompt in flight through two is a suspect (worker/dispatch.py)
        self.note: str | None = None  # what the worker waits on: the server's last answer, or its change
        self._check: asyncio.Future[ServerInfo] | None = None
        self._down = asyncio.Event()  # set when the server went down: recovery_loop takes over

    @property
    def down(self) -> bool:
        return self.down_since is not None

    @property
    def model(self) -> str | None:
        return self.info.model if self.info else None

    async def wait_for_server(self, on_waiting: Callable[[str], Awaitable[None]]) -> ServerInfo | None:
        """The server's info once it answers; None if stopped first."""
        started = time.monotonic()
        delay, next_note = 0.5, 0.0
        while not self.stopping.requested:
            try:
                self.info = await self.client.discover()
                return self.info
            except ServerUnavailable as exc:
                waited, limit = time.monotonic() - started, self.opts.server_start_timeout
                if limit is not None and waited >= limit:
                    raise ServerStartTimeout(f"server {self.opts.server_url} did not answer within {limit:.0f}s "
                                             f"(--server-start-timeout): {exc}") from None
                if waited >= next_note:
                    log.warning("waiting for server %s (%.0fs so far): %s", self.opts.server_url, waited, exc)
                    next_note = max(10.0, next_note * 2)
                await on_waiting(str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        return None

    async def is_down(self) -> bool:
        """Whether the server is down or not the one it was: one check for many failures."""
        if self.down:
            return True
        if self._check is None:
            self._check = asyncio.ensure_future(self.client.discover())
        try:
            why = self._change(await asyncio.shield(self._check))
        except ServerUnavailable:
            why = "health check failed"
        finally:
            if self._check is not None and self._check.done():
                self._check = None
        if why is not None and not self.down:
            self._went_down(why)
        return why is not None

    def _change(self, info: ServerInfo) -> str | None:
        """How the server now differs in a way its prompts must not meet, or None: what it says is adopted."""
        old = self.info
        if old is not None and old.model is not None and info.model is None:
            return f"it did not say which model it serves now (/v1/models; it served {old.model})"
        if old is not None and old.model is not None and info.model != old.model:
            return f"it serves model {info.model} now, not {old.model}"
        if old is not None and old.context_length and info.context_length and info.context_length < old.context_length:
            return f"its context is {info.context_length} tokens now, not {old.context_length}"
        if old is not None and info.context_length is None:
            info = msgspec.structs.replace(info, context_length=old.context_length)
        self.info = info
        return None

    def failed(self, why: str, since: float) -> None:
        """Nothing sent since `since` was answered while /health answers: down as a down server is, no crash
        counted; its batches go back --server-down-timeout after `since`, and it is tried again after that."""
        if not self.down:
            self.failing, self.failed_at = True, time.monotonic()
            log.warning("server %s is failing: %s; holding prompts, its batches back to the queue after "
                        "--server-down-timeout, tried again after that", self.opts.server_url, why)
            self._went_down(why)
            self.down_since = since

    def _went_down(self, why: str) -> None:
        self.down_since = time.monotonic()
        self.note = why
        self.metrics = None  # what a server that is gone said last is not what it does now
        if not self.failing:  # the requests that failed already count in Dispatcher._failed, those still out here
            self.outages += 1
            for task in self.running:
                task.crashed(self.outages)
            log.warning("server %s is down: holding prompts (no attempts counted) until it answers (%s); each prompt "
                        "in flight counts a server crash (--server-crash-limit)", self.opts.server_url, why)
        for task, aio in list(self.running.items()):
            task.cancel_reason = f"server down: {why}"
            aio.cancel()
        self._down.set()

    async def recovery_loop(self, hand_back_all: Callable[[str], Awaitable[None]]) -> None:
        """Polls a down server until it answers as it was; past --server-down-timeout (or another model) hands back."""
        url = self.opts.server_url
        while True:
            await self._down.wait()
            delay, handed_back = 0.5, False
            while self.down:
                await asyncio.sleep(delay)
                delay = min(delay * 1.5, 5.0)
                down_for = time.monotonic() - (self.down_since or time.monotonic())
                waiting = down_for <= self.opts.server_down_timeout
                if not waiting and not handed_back:
                    handed_back = True
                    await hand_back_all(f"server down for {down_for:.0f}s")
                try:
                    info = await self.client.discover()
                except ServerUnavailable as exc:
                    self.note = str(exc)
                    continue
                if (change := self._change(info)) is None:
                    if self.failing and waiting:  # its /health answered all along
                        continue
                elif change.startswith("it serves model"):  # its prompts go back to a server of their model
                    log.warning("server %s: %s; handing its batches back", url, change)
                    self.info = info  # first: a batch taken meanwhile is judged by the model served now
                    await hand_back_all(f"server now serves {info.model}")
                elif waiting:  # a smaller context: its prompts wait, or go to other workers (worker/intake.py)
                    if (note := f"{change}: waiting for it as it was (--server-down-timeout)") != self.note:
                        log.warning("server %s: %s", url, note)
                    self.note = note
                    continue
                else:
                    log.warning("server %s: %s for %.0fs: taken as it is", url, change, down_for)
                    self.info = info
                self.controller.set_capacity(info.capacity)
                log.info("server %s %s after %.1fs", url, "tried again (it was failing)" if self.failing else "is back",
                         down_for)
                self.down_since, self.note, self.failing = None, None, False
                self.todo.wake.set()
            self._down.clear()

    async def metrics_loop(self) -> None:
        while True:
            await asyncio.sleep(self.controller.look_interval_s)  # faster while it learns a capacity
            if self.down or self.info is None or not self.info.has_metrics:
                continue
            if (m := await self.client.metrics()) is None:
                continue
            self.metrics, before = m, self.controller.target
            self.controller.observe(m, self.running.sequences, len(self.todo))
            if self.controller.target != before:
                log.info("in-flight target %d -> %d (%s)", before, self.controller.target, self.controller.reason)
                self.todo.wake.set()

    async def watchdog(self) -> None:
        """Cancel requests that stalled or ran too long; probe a server silent with requests in flight."""
        opts = self.opts
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            queue_empty = self.metrics is not None and not self.metrics.waiting
            for task, aio in list(self.running.items()):
                p = task.progress
                if p.whole is not None:  # [DONE] came, the body never ends: the answer is recorded (worker/dispatch.py)
                    task.cancel_reason = "the stream's body did not end after its [DONE]"
                elif now - p.started > opts.request_timeout:
                    task.cancel_reason = f"request exceeded {opts.request_timeout:.0f}s (request timeout)"
                elif now - p.last_activity > opts.stall_timeout and (p.first_byte is not None or queue_empty):
                    task.cancel_reason = f"no output for {opts.stall_timeout:.0f}s (stall timeout)"
                else:
                    continue
                aio.cancel()
            if self.running and not self.down:
                latest = max(t.progress.last_activity for t in self.running)
                if now - latest > SILENT_PROBE_S and not await self.client.healthy():
                    self._went_down(f"no output from {plural(len(self.running), 'request')} for {now - latest:.0f}s "
                                    "and /health fails")

    async def admit(self, config: JobConfig) -> JobConfig | None:
        """The job's settings (`auto` pinned to this server's model), or None: another model's job, or gone."""
        if config.model == AUTO and (model := self.model) is not None:
            found, pinned = await ledger_jobs.pin_model(self.conn, config.name, model, AUTO)
            if found is None:
                return None
            if pinned:  # written before anything is sent: a job rebuilt from its output keeps its model
                log.info("job %s: --model auto resolved to %s, the model of the first server that took it; "
                         "pinned in its settings", found.name, model)
                try:
                    await asyncio.to_thread(keep_pin, found)
                except Exception as exc:  # the output unreachable: the maintenance pass writes it later
                    log.warning("job %s: cannot write its pinned model to %s: %s", found.name, found.output, exc)
            config = found
        return config if self.takes(config) else None

    def takes(self, config: JobConfig) -> bool:
        """Whether this server may run the job's prompts; another model's job is refused (said once)."""
        if config.served_by(self.model):
            return True
        if config.name not in self._told:
            self._told.add(config.name)
            log.warning("job %s is for model %s; this worker's server serves %s: it takes none of its batches "
                        "or prompts", config.name, config.model, self.model)
        return False


def servable_jobs(conn: redis.Redis, model: str | None, jobs: list[str]) -> list[str]:
    """Of these jobs, those a server serving `model` may run (for `genq workers`)."""
    return [job for job, config in zip(jobs, [n.config for n in ledger_jobs.jobs_now(conn, jobs)], strict=True)
            if config is not None and config.served_by(model)]


WINDOW = 24  # a job's recent outcomes on one engine that the brake looks at
TRIP_PROMPTS = 8  # different prompts failing the same way before a job is blocked
HOLD_S = 5.0  # longest a held failure waits for its verdict (the last prompts of a job)
CHECK_EVERY_S = 1.0

_NUMBER = re.compile(r"\d+")


def signature(failure: Failure) -> str:
    """What makes two failures "the same answer": the status and the message, numbers aside."""
    return f"{failure.status} {_NUMBER.sub('N', failure.message)}"


def preflight(config: JobConfig, server: ServerInfo | None) -> str | None:
    """Why `config` can never work against `server`, or None: a prompt has a token at least, so
    max_tokens at or over the context never fits (unknown context: the brake is the safeguard)."""
    context = server.context_length if server is not None else None
    if not context or config.max_tokens < context:
        return None
    assert server is not None
    return (f"max_tokens {config.max_tokens} (settings version {config.settings_version}) is not below "
            f"{server.engine.context_where} of {context} tokens on this {server.flavor} server: no prompt can fit "
            f"(prompt + max_tokens must fit in the context). Lower it with `genq jobs set {config.name} "
            f"--max-tokens N` (N < {context}), then `genq resume --job {config.name}`.")


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


class Gate:
    def __init__(self, batches: Batches, controller: ConcurrencyController | None, watch: ServerWatch | None) -> None:
        self.batches = batches  # admits, dead-letters and parks
        self.conn, self.worker, self.held = batches.conn, batches.worker, batches.held
        self.controller, self.watch = controller, watch  # watch: the server's context, for the preflight
        self.paused_all = self.draining = False
        self.paused_jobs: set[str] = set()
        self.last_beat = time.monotonic()  # the last lease check: one too old (a frozen process) stops dispatch
        self.windows: dict[str, JobWindow] = {}
        self.blocked: set[str] = set()  # jobs blocked as far as this engine knows
        self.pausing: set[str] = set()  # paused jobs being parked here
        # When this engine's block of a job landed in Redis (inf while stored): a read asked before says no lift.
        self._landed_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def why_not(self, job: str) -> str | None:
        """Why none of the job's prompts is sent now (blocked, paused), or None."""
        return "blocked" if job in self.blocked else "paused" if job in self.paused_jobs else None

    def leases_fresh(self) -> bool:
        return time.monotonic() - self.last_beat < LEASE_CHECK_STALE_S

    async def read(self, jobs: list[str]) -> bool:
        """The operator's controls for these jobs, applied; True if one changed."""
        assert self.controller is not None
        control, paused, paused_jobs = await fleet.read_controls(self.conn, self.worker, jobs)
        changed = paused != self.paused_all or paused_jobs != self.paused_jobs
        if control.drain and not self.draining:
            log.info("drain requested: finishing held batches, taking no new ones")
            self.draining = changed = True
        if (control.concurrency or None) != self.controller.live_cap:
            self.controller.set_cap(control.concurrency)
            log.info("concurrency cap now %s (target %d)", control.concurrency or "auto", self.controller.target)
            changed = True
        if paused != self.paused_all:
            log.info("%s all jobs", "paused:" if paused else "resumed:")
        # Said as changes, never the whole set; a job that leaves the set was resumed (or deleted).
        for word, jobs_now in (("paused", paused_jobs - self.paused_jobs), ("resumed", self.paused_jobs - paused_jobs)):
            if jobs_now:
                log.info("%s: %s", word, ", ".join(sorted(jobs_now)))
        self.paused_all, self.paused_jobs = paused, paused_jobs
        return changed

    def succeeded(self, task: Task) -> None:
        window = self.windows.setdefault(task.batch.ref.job, JobWindow())
        window.outcomes.append((None, task.prompt.id))
        if window.held:
            self.judge(task.batch.ref.job)

    def failed(self, task: Task, failure: Failure) -> bool:
        """A non-retryable failure: True if the brake holds it (or its job is blocked), False to dead-letter it."""
        job = task.batch.ref.job
        if job in self.blocked:
            return True
        if not task.batch.config.brake:
            return False
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
            prompts = len({pid for s, pid in window.outcomes if s == sig})
            if n >= WINDOW and prompts >= TRIP_PROMPTS and 2 * failures > n:
                self._trip(job, window, sig, failures, n, prompts)
                return
        now, keep = time.monotonic(), []
        for held in window.held:
            if 2 * counts.get(held.signature, 0) > n and now - held.since < HOLD_S:
                keep.append(held)
            else:
                self.batches.dead(held.task, held.failure)
        window.held = keep

    def judge_all(self) -> None:
        """Held failures past HOLD_S go to the dead-letter queue."""
        for job in [j for j, w in self.windows.items() if w.held]:
            self.judge(job)

    def _trip(self, job: str, window: JobWindow, sig: str, failures: int, n: int, prompts: int) -> None:
        example = next(h for h in window.held if h.signature == sig)
        f, kept = example.failure, len(window.held)
        window.held = []  # not dead-lettered: they stay unfinished, queued with the rest of the job
        log.error("job %s blocked by the brake: %d of its last %d requests here failed the same way across %d "
                  "prompts (%s%s: %s); its prompts stay queued (%d held back from the dead-letter queue). "
                  "Fix the settings (genq jobs set %s ...), then genq resume --job %s",
                  job, failures, n, prompts, f.kind, f" {f.status}" if f.status else "", f.message, kept, job, job)
        self.block(job, JobBlock(reason="brake", message=f.message, worker=self.worker, at=time.time(),
                                 settings_version=example.task.batch.config.settings_version,
                                 status=f.status, failures=failures, outcomes=n, prompts=prompts))

    def reset(self, job: str) -> None:
        """New settings, or resumed: old outcomes are no evidence; held ones are dead-lettered."""
        for held in self.windows.pop(job, JobWindow()).held:
            self.batches.dead(held.task, held.failure)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("blocked-job handling failed", exc_info=task.exception())

    async def admit(self) -> None:
        """Sends each loaded batch (Batches.arrived) at its job's settings now, unless blocked, paused or failing."""
        while True:
            held, prompts = await self.batches.arrived.get()
            self._spawn(self._admit(held, prompts))

    async def _admit(self, held: HeldBatch, prompts: list[Prompt]) -> None:
        job, asked = held.ref.job, time.monotonic()
        (now,) = await retrying(lambda: ledger_jobs.jobs_now(self.conn, [job]), f"checking job {job}")
        self._news(job, now, asked)
        if held.dropped or held.ref not in self.held:
            return  # handed back meanwhile (stopping)
        if job in self.blocked or now.paused:  # paused: its slots go to other jobs
            await self.park_job(job, quiet=True, cancel=job in self.blocked)
            return
        problem = preflight(held.config, self.watch.info if self.watch else None)
        if problem is not None and self.watch:  # judged by what the server says now (a larger context?)
            await self.watch.is_down()
            problem = preflight(held.config, self.watch.info)
        if problem is None:
            self.batches.send(held, prompts)
        else:
            self._block_preflight(job, held.config, problem, "before any request")

    def _block_preflight(self, job: str, config: JobConfig, problem: str, when: str) -> None:
        log.error("job %s blocked %s (preflight): %s", job, when, problem)
        self.block(job, JobBlock(reason="preflight", message=problem, worker=self.worker, at=time.time(),
                                 settings_version=config.settings_version))

    def block(self, job: str, record: JobBlock) -> None:
        """Block `job` (the first reason stored wins) and park what this engine holds of it."""
        self.blocked.add(job)
        self._landed_at[job] = float("inf")
        self._spawn(self._block(job, record))

    async def _block(self, job: str, record: JobBlock) -> None:
        try:
            await retrying(lambda: ledger_jobs.block_job(self.conn, job, record), f"blocking job {job}")
        finally:
            self._landed_at[job] = time.monotonic()
        await self.park_job(job)
        try:
            taken = await asyncio.to_thread(unqueue, self.batches.sync_conn, job)
        except (redis.RedisError, OSError) as exc:  # they are parked one by one as they arrive instead
            log.warning("job %s: could not take its batches out of RQ's queue (%s)", job, exc)
            return
        if taken:
            log.info("job %s: %d of its batches taken out of RQ's queue, parked until `genq resume --job %s`",
                     job, taken, job)

    def _news(self, job: str, now: ledger_jobs.JobNow, asked: float) -> None:
        """What Redis (read at `asked`) says of a job: blocked elsewhere, no longer blocked (not by a read from
        before our own block landed), newer settings."""
        if now.blocked and job not in self.blocked:
            log.warning("job %s is blocked (genq jobs show %s): parking its batches here", job, job)
            self.blocked.add(job)
            self._spawn(self.park_job(job))
        elif not now.blocked and job in self.blocked and asked > self._landed_at.get(job, float("-inf")):
            log.info("job %s is no longer blocked: taking its batches again", job)
            self.blocked.discard(job)
            self.reset(job)
        if now.config is not None:
            self._settings(job, now.config)

    async def park_job(self, job: str, *, quiet: bool = False, cancel: bool = True) -> None:
        """Park what is held of the job: blocked, its requests in flight are cancelled; paused, they finish."""
        parked = await self.batches.let_go_job(job, cancel=cancel, requeue=False)
        if parked:
            (log.debug if quiet else log.info)(
                "job %s is %s: parked %s (%s); their prompts wait for `genq resume --job %s`",
                job, "blocked" if cancel else "paused", plural(len(parked), "batch", "batches"), ", ".join(parked), job)

    async def _park_paused(self, job: str) -> None:
        # Only this park ends the `pausing` mark, else the next turn starts another on the same requests in flight.
        try:
            await self.park_job(job, cancel=False)
        finally:
            self.pausing.discard(job)

    def _settings(self, job: str, stored: JobConfig) -> None:
        """A newer settings version of a job held here: every unsent prompt gets it."""
        stale = [h for h in [*self.held.values(), *self.held.borrowed.values()]
                 if h.ref.job == job and h.config.incarnation == stored.incarnation
                 and h.config.settings_version < stored.settings_version and not h.dropped]
        if not stale:
            return
        if self.watch is not None and not self.watch.takes(stored):  # `jobs set --model`: not this server's
            self._spawn(self._hand_back(job, stored.settings_version))
            return
        for h in stale:
            h.config = stored
        self.reset(job)
        log.info("job %s: settings version %d from now on (%s held here)", job, stored.settings_version,
                 plural(len(stale), "batch", "batches"))
        problem = preflight(stored, self.watch.info if self.watch else None)
        if problem is not None and job not in self.blocked:
            self._block_preflight(job, stored, problem, "by its new settings")

    async def _hand_back(self, job: str, version: int) -> None:
        """A job's new settings are for another model: what is held goes back (requests in flight finish)."""
        given = await self.batches.let_go_job(job, cancel=False, requeue=True)
        if given:
            log.info("job %s: settings version %d is for another model: handed back %s (%s)", job, version,
                     plural(len(given), "batch", "batches"), ", ".join(given))

    async def run(self) -> None:
        """Every second: paused jobs parked, jobs' news read, held failures judged."""
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            # Paused jobs held here: parked once their requests in flight are done (docs/scheduling.md).
            for job in (self.paused_jobs & self.held.all_jobs()) - self.blocked - self.pausing:
                self.pausing.add(job)
                self._spawn(self._park_paused(job))
            try:
                jobs, asked = sorted(self.held.all_jobs() | self.blocked), time.monotonic()
                for job, now in zip(jobs, await ledger_jobs.jobs_now(self.conn, jobs) if jobs else []):
                    self._news(job, now, asked)
            except (redis.RedisError, OSError) as exc:
                log.debug("blocked/settings check skipped: %s", exc)
            self.judge_all()
