"""The server as the engine sees it: up or down, its metrics, and requests that stall.

- Breaker: after a failed request, one check (single flight) of /health and what the server says
  of itself. Down, or not the server it was (another model, a smaller context), the engine stops
  sending, counts no attempt, and polls until it answers as it was; after --server-down-timeout
  it hands its batches back (another model: at once; a smaller context is then taken as it is).
- A server silent while it holds requests is health-checked then, not only after a failure.
- Watchdog: a request with no output for --stall-timeout is cancelled and retried; before its
  first byte it waits in the server's queue, not a stall, unless the server says none waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec

from genq.core.words import plural
from genq.worker.answers import Running
from genq.worker.controller import ConcurrencyController
from genq.worker.engines import Metrics
from genq.worker.options import WorkerOptions
from genq.worker.server import ServerClient, ServerInfo, ServerUnavailable
from genq.worker.stopping import StopNow
from genq.worker.todo import Todo

log = logging.getLogger("genq.worker")

SILENT_PROBE_S = 15.0  # no output from any request in flight this long: ask /health


class ServerStartTimeout(Exception):
    """The server did not answer within --server-start-timeout."""


class ServerWatch:
    """Whether the server is up, as this watch alone decides (every other part reads it)."""

    def __init__(self, opts: WorkerOptions, client: ServerClient, controller: ConcurrencyController,
                 stopping: StopNow, running: Running, todo: Todo) -> None:
        self.opts = opts
        self.client = client
        self.controller = controller
        self.stopping = stopping
        self.running = running  # the dispatcher's requests in flight
        self.todo = todo  # the dispatcher's prompts not sent yet; its `wake` wakes the dispatcher
        self.info: ServerInfo | None = None
        self.metrics: Metrics | None = None
        self.down_since: float | None = None  # monotonic
        self.outages = 0  # since the start: a prompt in flight through two is a suspect (worker/dispatch.py)
        self.note: str | None = None  # what the worker waits on: the server's last answer, or its change
        self._check: asyncio.Future[str | None] | None = None
        self._down = asyncio.Event()  # set when the server went down: recovery_loop takes over

    @property
    def down(self) -> bool:
        return self.down_since is not None

    @property
    def model(self) -> str | None:
        return self.info.model if self.info else None

    async def wait_for_server(self, on_waiting: Callable[[str], Awaitable[None]]) -> ServerInfo | None:
        """The server's info once it answers, saying why it waits through `on_waiting`; None if
        stopped while waiting. Raises ServerStartTimeout after --server-start-timeout."""
        started = time.monotonic()
        delay, next_note = 0.5, 0.0
        while not self.stopping.requested:
            try:
                self.info = await self.client.discover()
                return self.info
            except ServerUnavailable as exc:
                waited = time.monotonic() - started
                limit = self.opts.server_start_timeout
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
        """Single-flight check after a failure (many failures, one probe): the server is down, or
        is not the one this engine knew (restarted with another model or a smaller context)."""
        if self.down:
            return True
        if self._check is None:
            self._check = asyncio.ensure_future(self._verify())
        try:
            why = await asyncio.shield(self._check)
        finally:
            if self._check is not None and self._check.done():
                self._check = None
        if why is not None and not self.down:
            self._went_down(why)
        return why is not None

    async def reread(self) -> ServerInfo | None:
        """What the server says about itself now (a preflight about to block a job asks: it may have
        restarted with a larger context)."""
        await self.is_down()
        return self.info

    async def _verify(self) -> str | None:
        """Why nothing can be sent to the server now, or None (what it says of itself is adopted)."""
        try:
            info = await self.client.discover()
        except ServerUnavailable:
            return "health check failed"
        change = self._change(info)
        if change is None:
            self._adopt(info)  # the same server (a larger context, another capacity: taken as they are)
        return change

    def _adopt(self, info: ServerInfo) -> None:
        """What the server says now; a context it did not tell this time (an endpoint failed) is kept.
        (A model it did not name is a change, never adopted.)"""
        if self.info is not None and info.context_length is None:
            info = msgspec.structs.replace(info, context_length=self.info.context_length)
        self.info = info

    def _change(self, info: ServerInfo) -> str | None:
        """How the server differs in a way its prompts must not meet: another model (its answers are
        not the job's), a smaller context (prompts that ran would fail). None: the same for them."""
        old = self.info
        if old is None:
            return None
        if old.model is not None and info.model is None:  # unconfirmed is not the same: nothing is sent yet
            return f"it did not say which model it serves now (/v1/models; it served {old.model})"
        if info.model != old.model and old.model is not None:
            return f"it serves model {info.model} now, not {old.model}"
        if old.context_length and info.context_length and info.context_length < old.context_length:
            return f"its context is {info.context_length} tokens now, not {old.context_length}"
        return None

    def _went_down(self, why: str) -> None:
        self.down_since = time.monotonic()
        self.note = why
        self.outages += 1
        self.metrics = None  # what a server that is gone said last is not what it does now
        in_flight = list(self.running)
        for task in in_flight:
            task.crashed(self.outages)
        log.warning("server %s is down: holding prompts (no attempts counted) until it answers (%s; "
                    "%d in flight counted a server crash)", self.opts.server_url, why, len(in_flight))
        self.running.cancel_all(f"server down: {why}")
        self._down.set()

    async def recovery_loop(self, hand_back_all: Callable[[str], Awaitable[None]]) -> None:
        """Polls a server that went down until it answers as it was; past --server-down-timeout (or
        serving another model) what is held goes back through `hand_back_all`."""
        while True:
            await self._down.wait()
            await self._await_recovery(hand_back_all)
            self._down.clear()

    async def _await_recovery(self, hand_back_all: Callable[[str], Awaitable[None]]) -> None:
        delay, handed_back = 0.5, False
        while True:
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 5.0)
            down_for = time.monotonic() - (self.down_since or time.monotonic())
            if down_for > self.opts.server_down_timeout and not handed_back:
                handed_back = True
                await hand_back_all(f"server down for {down_for:.0f}s")
            try:
                info = await self.client.discover()
            except ServerUnavailable as exc:
                self.note = str(exc)
                continue
            change = self._change(info)
            if change is not None and change.startswith("it serves model"):
                # Its held prompts are for another model: back to the queue for a server of theirs.
                log.warning("server %s: %s; handing its batches back", self.opts.server_url, change)
                await hand_back_all(f"server now serves {info.model}")
            elif change is not None and down_for <= self.opts.server_down_timeout:
                # A smaller context: its prompts wait, or go to other workers (worker/stealing.py).
                note = f"{change}: waiting for it as it was (--server-down-timeout)"
                if note != self.note:
                    log.warning("server %s: %s", self.opts.server_url, note)
                self.note = note
                continue
            elif change is not None:
                log.warning("server %s: %s for %.0fs: taken as it is", self.opts.server_url, change, down_for)
            if change is None:
                self._adopt(info)
            else:
                self.info = info  # another model, or a smaller context taken as it is now
            self.controller.set_capacity(info.capacity)
            log.info("server %s is back after %.1fs", self.opts.server_url, down_for)
            self.down_since = None
            self.note = None
            self.todo.wake.set()
            return

    async def metrics_loop(self) -> None:
        while True:
            await asyncio.sleep(self.controller.look_interval_s)  # faster while it learns a capacity
            if self.down or self.info is None or not self.info.has_metrics:
                continue
            m = await self.client.metrics()
            if m is None:
                continue
            self.metrics = m
            before = self.controller.target
            self.controller.observe(m, self.running.sequences, len(self.todo))
            if self.controller.target != before:
                log.info("in-flight target %d -> %d (%s)", before, self.controller.target, self.controller.reason)
                self.todo.wake.set()

    async def watchdog(self) -> None:
        """Cancel requests that stalled or ran too long (one timer for all, not one each);
        probe a server that went silent while holding requests."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            running = self.running
            queue_empty = self.metrics is not None and not self.metrics.waiting
            for task, aio in list(running.items()):
                p = task.progress
                waiting_in_server = p.first_byte is None and not queue_empty
                if now - p.started > self.opts.request_timeout:
                    task.cancel_reason = f"request exceeded {self.opts.request_timeout:.0f}s (request timeout)"
                elif now - p.last_activity > self.opts.stall_timeout and not waiting_in_server:
                    task.cancel_reason = f"no output for {self.opts.stall_timeout:.0f}s (stall timeout)"
                else:
                    continue
                aio.cancel()
            if running and not self.down:
                latest = max(t.progress.last_activity for t in running)
                if now - latest > SILENT_PROBE_S and not await self.client.healthy():
                    self._went_down(f"no output from {plural(len(running), 'request')} for {now - latest:.0f}s "
                                    "and /health fails")
