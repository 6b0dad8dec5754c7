"""Dispatch: one in-flight window of `controller.target` sequences over every held batch's prompts. Failures are
retried with capped exponential backoff; one while the server is down counts a crash, not an attempt (in flight
during two: a suspect, sent alone; `server_crash` after --server-crash-limit). A retryable failure is dead-lettered
at its last attempt only if the server answered a request sent after it first failed (evidence against the prompt).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import random
import time
from typing import Any

from genq.core.records import JobConfig
from genq.core.waits import wait_event
from genq.core.words import plural
from genq.worker.batches import Batches
from genq.worker.gate import Gate, ServerWatch
from genq.worker.held import Plan, RateWindow, Task
from genq.worker.options import WorkerOptions
from genq.worker.server import Completion, Failure, Progress, ServerClient, build_body, result_of, samples

log = logging.getLogger("genq.worker")

# Prompts are claimed ahead of the free slots, a quarter of the target at a time, the next group once half a
# group is left: a freed slot never waits on Redis, and the rest stays for idle engines.
CLAIM_AHEAD_MIN = 2
# Nothing answered this long: the server is checked before the next request (a restart with nothing in flight
# fails nothing; genq sim restarts in 0.5 s).
IDLE_CHECK_S = 0.25
FAILURE_NOTE_EVERY_S = 60.0  # requests failing while the server is up: a WARNING this often at most


def claim_ahead(target: int) -> int:
    return max(CLAIM_AHEAD_MIN, target // 4)


def claim_step(target: int) -> int:
    return max(1, claim_ahead(target) // 2)


def to_claim(target: int, in_flight: int, ready: int, suspects: int, per: int) -> int:
    """Prompts to claim, counted in sequences like the window (`per`: the backlog's next prompt's samples)."""
    want = target + claim_ahead(target) + claim_step(target) - in_flight - per * (ready + suspects)
    if want >= per and (want >= claim_ahead(target) or not ready):  # a whole group, or any when dry
        return want // per
    # Dry with a slot free, yet one prompt is more sequences than the slack (n > a quarter of the target).
    return 1 if not ready and not suspects and in_flight < target else 0


class Dispatcher:
    def __init__(self, opts: WorkerOptions, client: ServerClient, batches: Batches, watch: ServerWatch, gate: Gate,
                 plan: Plan | None = None) -> None:
        self.opts, self.client, self.watch = opts, client, watch
        self.controller, self.stopping = watch.controller, watch.stopping
        self.batches, self.writer, self.todo, self.running = batches, batches.writer, batches.todo, batches.running
        self.gate = gate  # the operator's controls, the brake, parking
        self.plan = plan  # which job's prompts are claimed next (Shares.plan, worker/intake.py)
        self.hold_back = False  # the end of the queue: faster workers finish the unsent prompts (worker/intake.py)
        self.rates = RateWindow()
        self.verifying = 0  # connection failures whose server check is not back yet: nothing is sent meanwhile
        self.observed = time.monotonic()  # when the server last answered anything, or was checked
        self.answered = 0.0  # when the latest request this server answered normally was sent (monotonic)
        self.wake = self.todo.wake  # set by whatever may have made a prompt sendable
        self.failed_since_note, self.next_failure_note = 0, 0.0

    @property
    def unsent(self) -> int:
        return len(self.todo)

    def accepting(self) -> bool:
        return not (self.gate.draining or self.gate.paused_all or self.stopping.requested or self.watch.down)

    def _open(self) -> bool:
        """Sending and claiming allowed (claims need no free slot)."""
        return (not self.watch.down and not self.verifying and not self.gate.paused_all
                and self.stopping.requested < 2 and self.gate.leases_fresh())

    async def run(self) -> None:
        while True:
            timeout = max(0.0, self.todo.delayed[0][0] - time.monotonic()) if self.todo.delayed else None
            await wait_event(self.wake, timeout)  # not wait_for: a stop must not be swallowed (core/waits.py)
            self.wake.clear()
            now = time.monotonic()
            while self.todo.delayed and self.todo.delayed[0][0] <= now:
                due = heapq.heappop(self.todo.delayed)[2]
                (self.todo.suspects if self._suspect(due) else self.todo.ready).appendleft(due)
            for job in [j for j in self.todo.parked if not self.gate.why_not(j)]:
                self.todo.ready.extendleft(reversed(self.todo.parked.pop(job)))
            await self.todo.release_let_go()
            if self._open() and not self.hold_back and self.todo.waiting and (want := self._to_claim()):
                stopped = {h.ref.job for h in self.todo.waiting if self.gate.why_not(h.ref.job)}
                await self.todo.claim(want, stopped, self.plan)
            if (self.todo.ready and not self.running and self._open()
                    and time.monotonic() - self.observed > IDLE_CHECK_S):
                await self._check(gate=True)  # a restart while nothing was in flight showed no failure
            while (task := self._take()) is not None:
                self.running[task] = asyncio.create_task(self._send(task))

    def _to_claim(self) -> int:
        held, tasks = next(iter(self.todo.waiting.items()))
        return to_claim(self.controller.target, self.running.sequences, len(self.todo.ready),
                        len(self.todo.suspects), samples(held.config, tasks[0].prompt) if tasks else 1)

    def _take(self) -> Task | None:
        """The next prompt to send, if the window has room: a crash suspect only when none is in flight."""
        while self._open() and self.running.sequences < self.controller.target:
            if self.todo.suspects and not any(self._suspect(t) for t in self.running):
                task = self.todo.suspects.popleft()
            elif self.todo.ready:
                task = self.todo.ready.popleft()
            else:
                return None
            if task.batch.dropped:
                self.todo.let_go(task)
                continue
            if self.gate.why_not(task.batch.ref.job):
                self.todo.parked.setdefault(task.batch.ref.job, []).append(task)
                continue
            task.progress = Progress(meter=self.running.meter, sequences=samples(task.batch.config, task.prompt))
            task.answered_before = self.answered
            task.cancel_reason = None
            return task
        return None

    async def _send(self, task: Task | None) -> None:
        # One asyncio task sends prompt after prompt: a task per request costs half the HTTP request (fast server).
        me = asyncio.current_task()
        assert me is not None
        while task is not None:
            config = task.batch.config
            model = config.model if config.model != "auto" else self.watch.model or "default"
            body = build_body(config, task.prompt, model, self.opts.stream)
            try:
                try:
                    outcome: Completion | Failure = await self.client.generate(config.endpoint, body, task.progress)
                except asyncio.CancelledError:
                    if task.cancel_reason is None:
                        raise  # shutdown, hand-back or a dropped batch: nothing is recorded or counted
                    me.uncancel()  # the watchdog's cancel was for this request only
                    outcome = Failure("connection" if task.cancel_reason.startswith("server down") else "timeout",
                                      task.cancel_reason)
                    if task.progress.whole is not None:  # cancelled after its [DONE]: the answer is whole
                        outcome = task.progress.whole.outcome()
                # No longer in flight: the watchdog must not cancel the bookkeeping below.
                self.running.pop(task, None)
                self.observed = time.monotonic()
                failure = self._record(task, body, outcome, config) if isinstance(outcome, Completion) else outcome
                if failure is not None:
                    await self._failed(task, failure)
                    self.wake.set()  # a retry may now be due: the loop times it
            finally:
                self.running.pop(task, None)
            task = self._take()
            if task is not None:
                self.running[task] = me
            if self.todo.waiting and not self.hold_back and self._to_claim():
                self.wake.set()  # claim more before the slots run dry
        self.wake.set()

    def _record(self, task: Task, body: dict[str, Any], c: Completion, sent: JobConfig) -> Failure | None:
        """Records the answer, or returns why it is not what the request asked for."""
        held, latency = task.batch, time.monotonic() - task.progress.started
        result = result_of(body, c, prompt=task.prompt, job=held.ref.job, batch=held.ref.batch,
                           worker=self.writer.worker,
                           attempts=task.lost + task.attempts + 1, latency_s=latency,
                           settings_version=sent.settings_version)
        if isinstance(result, Failure):
            return result
        self.writer.add_result(result, sent.incarnation)
        self.answered = max(self.answered, task.progress.started)
        self.rates.add(c.usage.completion_tokens, latency)
        self.gate.succeeded(task)
        return None

    def _suspect(self, task: Task) -> bool:
        return task.crashes >= max(1, min(2, self.opts.server_crash_limit - 1))

    async def _failed(self, task: Task, failure: Failure) -> None:
        held = task.batch
        if held.dropped:  # let go meanwhile (done or leased elsewhere, handed back): not sent again here
            self.todo.let_go(task)
            return
        if not failure.retryable and await self._check(gate=False):
            # Answered by a server that is not the one the prompt ran on (restarted smaller): no attempt.
            self.todo.ready.appendleft(task)
            return
        if (failure.kind in ("connection", "timeout", "server_error") and not self.watch.failing
            and await self._check(failure.kind == "connection")):
            # The server is down, not (necessarily) the prompt: no attempt is counted.
            task.crashed(self.watch.outages)
            if task.crashes >= self.opts.server_crash_limit:
                self.batches.dead(task, Failure(
                    "server_crash", f"the server went down {plural(task.crashes, 'time')} "
                    "while this prompt was in flight "
                    f"(sent alone after the first); last error: {failure.kind}: {failure.message}"))
                return
            (self.todo.suspects if self._suspect(task) else self.todo.ready).appendleft(task)
            return
        task.attempts += 1
        self.rates.error(held.ref.job)
        self.failed_since_note += 1
        status = f"HTTP {failure.status} " if failure.status else ""
        latest = f"{status}{failure.kind}: {' '.join(failure.message.split())}"
        if (now := time.monotonic()) >= self.next_failure_note:  # one line now and then, not one a request
            log.warning("server %s: %s failed while it is up (said every %.0fs at most); latest: %s",
                        self.opts.server_url, plural(self.failed_since_note, "request"), FAILURE_NOTE_EVERY_S, latest)
            self.failed_since_note, self.next_failure_note = 0, now + FAILURE_NOTE_EVERY_S
        max_attempts = self.opts.max_attempts or held.config.max_attempts
        task.failing_since = task.progress.started if task.failing_since is None else task.failing_since
        # No evidence against the prompt (the server answered nothing sent since it first failed): retried for
        # --server-down-timeout; then, or at once while none was answered since, the server is failing, not it.
        unproven = task.answered_before <= task.failing_since
        if unproven and failure.retryable and (time.monotonic() - task.failing_since >= self.opts.server_down_timeout
                                               or self.answered < self.watch.failed_at):
            self.todo.ready.appendleft(task)
            self.watch.failed(f"nothing sent was answered for {time.monotonic() - task.failing_since:.0f}s while "
                              f"/health answers; latest: {latest}", task.failing_since)
            return
        task.busy += failure.status in (429, 503)
        if failure.retryable and (task.attempts - task.busy < max_attempts or unproven):
            delay = (min(self.opts.retry_backoff_max, self.opts.retry_backoff * 2 ** (task.attempts - 1))
                     * random.uniform(0.5, 1.5))
            # Never sooner than the server's Retry-After, nor later than --retry-backoff-max for it.
            delay = max(delay, min(failure.retry_after or 0.0, self.opts.retry_backoff_max))
            self.todo.retry_at(time.monotonic() + delay, task)
            log.debug("prompt %s attempt %d failed (%s: %s); retry in %.1fs%s",
                      task.prompt.id, task.attempts, failure.kind, failure.message, delay,
                      "" if task.attempts - task.busy < max_attempts else " (the server had answered nothing sent "
                      "since it first failed: no evidence it is the prompt's fault)")
            return
        if not failure.retryable and self.gate.failed(task, failure):
            return  # held by the brake: dead-lettered once judged, or kept queued with its blocked job
        self.batches.dead(task, failure)

    async def _check(self, gate: bool) -> bool:
        """Is the server down, or not the one it was? With `gate` nothing is sent until it says."""
        self.verifying += gate
        try:
            return await self.watch.is_down()
        finally:
            self.verifying -= gate
            self.observed = time.monotonic()
            self.wake.set()
