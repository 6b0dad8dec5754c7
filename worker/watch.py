"""The server as the worker sees it. Down (a failed /health), another model or a smaller context: nothing is sent,
no attempt counted, polled until it answers as it was; after --server-down-timeout its batches go back (another
model: at once). A job is for one model: `--model auto` is pinned to the first taker's server's."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec
import redis

from genq.core.ledger import jobs as ledger_jobs
from genq.core.records import JobConfig
from genq.core.words import plural
from genq.worker.batches import Batches
from genq.worker.controller import ConcurrencyController
from genq.worker.engines import Metrics
from genq.worker.options import WorkerOptions
from genq.worker.server import ServerClient, ServerInfo, ServerUnavailable

log = logging.getLogger("genq.worker")

SILENT_PROBE_S = 15.0  # no output from any request in flight this long: ask /health
AUTO = "auto"


class Stopping(Protocol):
    """The engine's StopNow as the parts read it: 1 finish what is held, 2 stop now."""

    requested: int


class ServerStartTimeout(Exception):
    """The server did not answer within --server-start-timeout."""


class ServerWatch:
    """Whether the server is up, as this watch alone decides; its metrics feed the controller; the watchdog
    cancels stalled requests."""

    def __init__(self, opts: WorkerOptions, client: ServerClient, controller: ConcurrencyController,
                 stopping: Stopping, batches: Batches) -> None:
        self.opts, self.client, self.controller, self.stopping = opts, client, controller, stopping
        self.conn, self.running, self.todo = batches.conn, batches.running, batches.todo  # in flight; unsent
        self._told: set[str] = set()  # jobs of another model whose refusal was logged
        self.info: ServerInfo | None = None
        self.metrics: Metrics | None = None
        self.down_since: float | None = None  # monotonic
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

    async def reread(self) -> ServerInfo | None:
        """What the server says of itself now (a preflight about to block a job: a larger context?)."""
        await self.is_down()
        return self.info

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

    def _went_down(self, why: str) -> None:
        self.down_since = time.monotonic()
        self.note = why
        self.outages += 1
        self.metrics = None  # what a server that is gone said last is not what it does now
        for task in self.running:
            task.crashed(self.outages)
        log.warning("server %s is down: holding prompts (no attempts counted) until it answers (%s; "
                    "%d in flight counted a server crash)", self.opts.server_url, why, len(self.running))
        self.running.cancel_all(f"server down: {why}")
        self._down.set()

    async def recovery_loop(self, hand_back_all: Callable[[str], Awaitable[None]]) -> None:
        """Polls a server that went down until it answers as it was; past --server-down-timeout (or serving
        another model) what is held goes back."""
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
                    pass
                elif change.startswith("it serves model"):  # its prompts go back to a server of their model
                    log.warning("server %s: %s; handing its batches back", url, change)
                    await hand_back_all(f"server now serves {info.model}")
                    self.info = info
                elif waiting:  # a smaller context: its prompts wait, or go to other workers (worker/stealing.py)
                    if (note := f"{change}: waiting for it as it was (--server-down-timeout)") != self.note:
                        log.warning("server %s: %s", url, note)
                    self.note = note
                    continue
                else:
                    log.warning("server %s: %s for %.0fs: taken as it is", url, change, down_for)
                    self.info = info
                self.controller.set_capacity(info.capacity)
                log.info("server %s is back after %.1fs", url, down_for)
                self.down_since = self.note = None
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
                if now - p.started > opts.request_timeout:
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
        model = self.model
        if config.model == AUTO and model is not None:
            found, pinned = await ledger_jobs.pin_model(self.conn, config.name, model, AUTO)
            if pinned:
                log.info("job %s: --model auto resolved to %s, the model of the first server that took it; "
                         "pinned in its settings", config.name, model)
            if found is None:
                return None
            config = found
        return config if self.takes(config) else None

    def takes(self, config: JobConfig) -> bool:
        """Whether this server may run the job's prompts; another model's job is refused (said once)."""
        if serves(config.model, self.model):
            return True
        if config.name not in self._told:
            self._told.add(config.name)
            log.warning("job %s is for model %s; this worker's server serves %s: it takes none of its batches "
                        "or prompts", config.name, config.model, self.model)
        return False


def serves(job_model: str, server_model: str | None) -> bool:
    """Whether a server of server_model may run a job for job_model; one that lists none is trusted."""
    return job_model == AUTO or server_model is None or job_model == server_model


def servable_jobs(conn: redis.Redis, model: str | None, jobs: list[str]) -> list[str]:
    """Of these jobs, those a server serving `model` may run (for `genq workers`)."""
    return [job for job, config in zip(jobs, [n.config for n in ledger_jobs.jobs_now(conn, jobs)], strict=True)
            if config is not None and serves(config.model, model)]
