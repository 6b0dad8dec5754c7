"""Continuous-batching model of one GPU server: pure asyncio, no HTTP.

One loop task plays the scheduler. Each iteration admits waiting requests in FIFO
order while there is a free slot (max_running_requests) and KV room
(max_total_num_tokens), sleeps for one step, then advances every running request
by tokens_per_step tokens. Handlers submit SimRequests and await their progress.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from genq.sim.config import SimConfig


class QueueFull(Exception):
    """The waiting queue holds max_queued_requests requests already."""


@dataclass(slots=True, eq=False)
class SimRequest:
    """One generation in the engine (slotted and hashed by identity: the engine keys its
    queues by it and touches it on every step)."""

    key: str
    prompt_tokens: int
    natural_tokens: int
    max_new_tokens: int
    stream: bool
    generated: int = 0
    # None while in flight; "stop" | "length" | "abort" once done.
    finish_reason: str | None = None
    # True when the connection must be reset (reset fault, outage).
    dropped: bool = False
    # Token counts at which a hang / a connection drop strikes (faults).
    hang_at: int | None = None
    drop_at: int | None = None
    waiter: asyncio.Future[None] | None = None
    target: int = field(init=False)
    # "stop" when the model ends on its own, "length" when max_tokens cuts it.
    natural_finish: str = field(init=False)

    def __post_init__(self) -> None:
        self.target = min(self.natural_tokens, self.max_new_tokens)
        self.natural_finish = "stop" if self.natural_tokens <= self.max_new_tokens else "length"


@dataclass
class Stats:
    """Figures since start or the last reset; time integrals give time-weighted means."""

    start: float
    last_change: float
    running_integral: float = 0.0
    waiting_integral: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    # Generation requests received, answered or refused (a 400 too): "no request was sent" is testable.
    requests: int = 0
    first_admit: float | None = None
    last_finish: float | None = None
    # Engine steps, request-steps (sum of the batch size over steps), and steps that ran with a free
    # slot while a request waited (0 unless the KV budget held it back): counts, not times.
    steps: int = 0
    request_steps: int = 0
    starved_steps: int = 0
    # prompt_key -> number of complete generations (aborts excluded).
    generated_by_key: dict[str, int] = field(default_factory=dict)

    def account(self, now: float, running: int, waiting: int) -> None:
        dt = now - self.last_change
        self.running_integral += running * dt
        self.waiting_integral += waiting * dt
        self.last_change = now

    def snapshot(self, now: float, running: int, waiting: int) -> dict[str, Any]:
        elapsed = now - self.start
        # The busy window runs from the first admission to the last finish (or now while work remains):
        # its means ignore idle time around a batch.
        busy = 0.0
        if self.first_admit is not None:
            end = now if (running or waiting or self.last_finish is None) else self.last_finish
            busy = max(end - self.first_admit, 0.0)
        wall = now - time.time()  # the two instants also on the wall clock, to compare servers (a fleet's makespan)
        first, last = self.first_admit, self.last_finish
        return {
            "elapsed_s": elapsed,
            "mean_running": self.running_integral / elapsed if elapsed > 0 else 0.0,
            "busy_s": busy,
            "busy_mean_running": self.running_integral / busy if busy > 0 else 0.0,
            "busy_mean_waiting": self.waiting_integral / busy if busy > 0 else 0.0,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "finished_requests": self.finished,
            "generation_requests": self.requests,
            "aborted_requests": self.aborted,
            "first_admit_s": None if first is None else first - self.start,
            "last_finish_s": None if last is None else last - self.start,
            "first_admit_at": None if first is None else first - wall,
            "last_finish_at": None if last is None else last - wall,
            "num_running": running,
            "num_waiting": waiting,
            "generated_by_key": self.generated_by_key,
            "steps": self.steps,
            "request_steps": self.request_steps,
            "starved_steps": self.starved_steps,
        }


class Engine:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        # Insertion-ordered dicts used as ordered sets: O(1) removal on abort.
        self._waiting: dict[SimRequest, None] = {}
        self._running: dict[SimRequest, None] = {}
        self.used_tokens = 0  # KV cache in use: prompt + generated tokens of running requests
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        now = time.monotonic()
        self.stats = Stats(now, now)
        # Prometheus counters: monotonic since start, never reset.
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_requests_total = 0
        self.num_aborted_total = 0
        self.last_gen_throughput = 0.0
        self._tp_since = now
        self._tp_tokens = 0
        # The counts as vLLM's scheduler reports them: make_stats() runs after the step's finished
        # requests left and before the step's arrivals join the queue (vllm/v1/core/sched/scheduler.py,
        # 0.32), so waiting counts only those the step's admission left out.
        self.stepped_running = 0
        self.stepped_waiting = 0
        self._left_out = 0

    # ---- lifecycle -------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    # ---- requests --------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, req: SimRequest) -> None:
        limit = self.config.max_queued_requests
        if limit is not None:
            # Requests the next step will admit into free slots are not queued.
            free = max(self.config.max_running_requests - len(self._running), 0)
            if len(self._waiting) >= limit + free:
                raise QueueFull
        self._account()
        self._waiting[req] = None
        self._wakeup.set()

    async def wait(self, req: SimRequest, seen: int) -> None:
        """Return once req has more than `seen` tokens or has finished. Non-stream
        requests are only woken at the end, which keeps the instant mode cheap."""
        if req.finish_reason is None and req.generated <= seen:
            req.waiter = asyncio.get_running_loop().create_future()
            await req.waiter

    def abort(self, req: SimRequest, dropped: bool = False) -> None:
        """Stop req wherever it is (client gone, reset fault, outage); idempotent."""
        if req.finish_reason is not None:
            return
        self._account()
        if req in self._running:
            del self._running[req]
            self.used_tokens -= req.prompt_tokens + req.generated
        else:
            self._waiting.pop(req, None)
        req.finish_reason = "abort"
        req.dropped = dropped
        self.stats.aborted += 1
        self.num_aborted_total += 1
        self.num_requests_total += 1
        _wake(req)
        # A freed slot may let a waiting request in (the loop may be parked).
        self._wakeup.set()

    def drop_all(self) -> None:
        """A crash: every request in flight loses its connection."""
        for req in [*self._running, *self._waiting]:
            self.abort(req, dropped=True)

    # ---- statistics ------------------------------------------------------

    def reset_stats(self) -> None:
        now = time.monotonic()
        self.stats = Stats(now, now)

    def stats_snapshot(self) -> dict[str, Any]:
        now = self._account()
        return self.stats.snapshot(now, len(self._running), len(self._waiting))

    def _account(self) -> float:
        """Called before every change of the running/waiting counts; returns the time."""
        now = time.monotonic()
        self.stats.account(now, len(self._running), len(self._waiting))
        return now

    # ---- scheduler loop --------------------------------------------------

    async def _loop(self) -> None:
        cfg = self.config
        base_s = cfg.step_ms_base / 1000.0
        per_req_s = cfg.step_ms_per_req / 1000.0
        prefill_cost = cfg.prefill_cost / max(1, cfg.tokens_per_step)  # a prompt token's, per running request's
        while True:
            # Cleared before looking at the queues: a submit or abort from here on
            # sets it again, so no wake-up is lost between the check and the wait.
            self._wakeup.clear()
            if not self._running and not self._waiting:
                # Idle: no step cost, no throughput; sleep until a submit.
                self.last_gen_throughput = 0.0
                await self._wakeup.wait()
                self._tp_since, self._tp_tokens = time.monotonic(), self.generation_tokens_total
                continue
            admitted = self._admit()
            st = self.stats
            st.steps += 1
            st.request_steps += len(self._running)
            if self._waiting and len(self._running) < cfg.max_running_requests:
                st.starved_steps += 1
            delay = base_s + per_req_s * (len(self._running) + (admitted or 0) * prefill_cost)
            # sleep(0) still yields, so in the instant mode handlers can queue
            # more requests and the next step serves them as one batch.
            await asyncio.sleep(delay)
            progressed = self._step()
            if delay == 0 and not progressed and admitted is None:
                # Only hung requests left in the instant mode: wait for a change
                # instead of spinning.
                await self._wakeup.wait()

    def _admit(self) -> int | None:
        """Admit what fits; returns the prompt tokens admitted (this step prefills them), None: none."""
        cfg = self.config
        now = self._account()
        admitted: int | None = None
        while self._waiting and len(self._running) < cfg.max_running_requests:
            req = next(iter(self._waiting))
            # An empty batch always takes the head request, so no prompt can block
            # the queue forever. The sim never retracts: running requests may grow
            # past the budget, which only delays further admissions.
            if self._running and self.used_tokens + req.prompt_tokens > cfg.max_total_num_tokens:
                break
            del self._waiting[req]
            self._running[req] = None
            self.used_tokens += req.prompt_tokens
            # Admission is the prefill: the prompt counts as processed now.
            self.stats.prompt_tokens += req.prompt_tokens
            self.prompt_tokens_total += req.prompt_tokens
            admitted = (admitted or 0) + req.prompt_tokens
            if self.stats.first_admit is None:
                self.stats.first_admit = now
        self._left_out = len(self._waiting)
        return admitted

    def _step(self) -> bool:
        """Advance every running request by one step; True if anything changed."""
        tps = self.config.tokens_per_step
        now = self._account()
        produced = 0
        ended = 0
        for req in list(self._running):
            limit = req.target
            if req.hang_at is not None:
                limit = min(limit, req.hang_at)
            if req.drop_at is not None:
                limit = min(limit, req.drop_at)
            new = min(req.generated + tps, limit)
            delta = new - req.generated
            req.generated = new
            self.used_tokens += delta
            produced += delta
            if new >= req.target:
                self._finish(req, now)
                ended += 1
            elif req.drop_at is not None and new >= req.drop_at:
                self.abort(req, dropped=True)
                ended += 1
            elif delta and req.stream:
                _wake(req)
        self.stats.generated_tokens += produced
        self.generation_tokens_total += produced
        if now - self._tp_since >= 1.0:
            self.last_gen_throughput = (self.generation_tokens_total - self._tp_tokens) / (now - self._tp_since)
            self._tp_since, self._tp_tokens = now, self.generation_tokens_total
        self.stepped_running = len(self._running)
        self.stepped_waiting = min(self._left_out, len(self._waiting))  # less any aborted meanwhile
        return produced > 0 or ended > 0

    def _finish(self, req: SimRequest, now: float) -> None:
        del self._running[req]
        self.used_tokens -= req.prompt_tokens + req.generated
        req.finish_reason = req.natural_finish
        s = self.stats
        s.finished += 1
        s.last_finish = now
        s.generated_by_key[req.key] = s.generated_by_key.get(req.key, 0) + 1
        self.num_requests_total += 1
        _wake(req)


def _wake(req: SimRequest) -> None:
    """Resolve whoever waits on this request's progress (a handler streaming it)."""
    waiter = req.waiter
    if waiter is not None:
        req.waiter = None
        if not waiter.done():
            waiter.set_result(None)
