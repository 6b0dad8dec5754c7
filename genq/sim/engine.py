"""Continuous-batching model of one GPU server, no HTTP: one loop task plays the scheduler. Each step admits
waiting requests in FIFO order while there is a free slot (max_running_requests) and KV room
(max_total_num_tokens), sleeps for the step's cost, then advances every running request by tokens_per_step."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from genq.sim.config import SimConfig

# The counts that /sim/stats and the Prometheus counters both keep.
_COUNTED = ("prompt_tokens", "generated_tokens", "finished_requests", "aborted_requests")


@dataclass(slots=True, eq=False)
class SimRequest:
    key: str
    prompt_tokens: int
    natural_tokens: int
    max_new_tokens: int
    stream: bool
    generated: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" once done
    dropped: bool = False  # its connection must be reset (reset fault, outage)
    hang_at: int | None = None  # faults: the token count at which its output stops, or it is dropped
    drop_at: int | None = None
    # Set on each step's output (a stream) and at the end; the n choices of one request share it.
    event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def target(self) -> int:
        return min(self.natural_tokens, self.max_new_tokens)


def new_stats() -> dict[str, Any]:
    """/sim/stats' figures since start or /sim/reset; starved steps: a slot free while one waited (KV budget);
    generated_by_key: per prompt key; max_running: the most requests running at once (a peak that sampling misses)."""
    now = time.monotonic()
    return {"start": now, "last_change": now, "running_integral": 0.0, "waiting_integral": 0.0, "first_admit": None,
            "last_finish": None, **dict.fromkeys((*_COUNTED, "generation_requests", "steps", "request_steps",
                                                  "starved_steps", "max_running"), 0), "generated_by_key": {}}


class Engine:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        # Insertion-ordered dicts as ordered sets: O(1) removal on abort.
        self.waiting: dict[SimRequest, None] = {}
        self.running: dict[SimRequest, None] = {}
        self.used_tokens = 0  # KV cache in use: prompt + generated tokens of running requests
        self._wakeup = asyncio.Event()
        self.stats = new_stats()
        self.totals = dict.fromkeys(_COUNTED, 0)  # Prometheus counters: those of stats, never reset
        self.streamed = dict.fromkeys(_COUNTED, 0)  # of the totals, streamed requests' (SGLang's is_streaming)
        self.last_gen_throughput = 0.0
        self._tp_since, self._tp_tokens = time.monotonic(), 0
        # The counts as vLLM 0.32's scheduler reports them: make_stats() runs after the step's finished
        # requests left and before its arrivals join the queue, so waiting counts only those left out.
        self.stepped_running = self.stepped_waiting = self._left_out = 0

    def submit(self, req: SimRequest) -> bool:
        """Queue req; False when max_queued_requests wait already (beyond those the next step admits)."""
        limit, free = self.config.max_queued_requests, self.config.max_running_requests - len(self.running)
        if limit is not None and len(self.waiting) >= limit + max(free, 0):
            return False
        self._account()
        self.waiting[req] = None
        self._wakeup.set()
        return True

    def abort(self, req: SimRequest, dropped: bool = False) -> None:
        """Stop req wherever it is (client gone, reset fault, outage); a no-op once it is out of the engine."""
        if req in self.running or req in self.waiting:
            self._end(req, "abort")
            req.dropped = dropped
            self._count("aborted_requests", 1, req.stream)
            self._wakeup.set()  # a freed slot may let a waiting request in

    def _end(self, req: SimRequest, reason: str) -> None:
        """req leaves the engine, finished ("stop" or "length") or aborted."""
        self._account()
        if req in self.running:
            del self.running[req]
            self.used_tokens -= req.prompt_tokens + req.generated
        self.waiting.pop(req, None)
        req.finish_reason = reason
        req.event.set()

    def _count(self, name: str, n: int, streamed: int) -> None:
        self.stats[name] += n
        self.totals[name] += n
        self.streamed[name] += streamed

    def stats_snapshot(self) -> dict[str, Any]:
        now, st, running, waiting = self._account(), self.stats, len(self.running), len(self.waiting)
        elapsed, first, last, integral = now - st["start"], st["first_admit"], st["last_finish"], st["running_integral"]
        # The busy window, first admission to last finish (or now while work remains), leaves out idle time.
        busy = 0.0 if first is None else max((now if running or waiting or last is None else last) - first, 0.0)
        # first_admit and last_finish since start, and on the wall clock too (_at), to compare servers.
        instants = {f"{name}_{unit}": None if t is None else t - zero for name, t in (("first_admit", first),
                    ("last_finish", last)) for unit, zero in (("s", st["start"]), ("at", now - time.time()))}
        return {**st, **instants, "elapsed_s": elapsed, "busy_s": busy, "num_running": running,
                "num_waiting": waiting, "mean_running": integral / elapsed if elapsed > 0 else 0.0,
                "busy_mean_running": integral / busy if busy > 0 else 0.0,
                "busy_mean_waiting": st["waiting_integral"] / busy if busy > 0 else 0.0}

    def _account(self) -> float:
        """Called before every change of the running/waiting counts; returns the time."""
        now, st = time.monotonic(), self.stats
        st["running_integral"] += len(self.running) * (now - st["last_change"])
        st["waiting_integral"] += len(self.waiting) * (now - st["last_change"])
        st["last_change"] = now
        return now

    async def run(self) -> None:
        cfg = self.config
        base_s, per_req_s = cfg.step_ms_base / 1000.0, cfg.step_ms_per_req / 1000.0
        prefill_cost = cfg.prefill_cost / max(1, cfg.tokens_per_step)  # a prompt token's, per running request's
        while True:
            # Cleared before looking at the queues: a submit or abort from here on sets it again.
            self._wakeup.clear()
            if not self.running and not self.waiting:
                self.last_gen_throughput = 0.0
                await self._wakeup.wait()
                self._tp_since, self._tp_tokens = time.monotonic(), self.totals["generated_tokens"]
                continue
            admitted, st = self._admit(), self.stats
            st["steps"] += 1
            st["request_steps"] += len(self.running)
            st["starved_steps"] += bool(self.waiting) and len(self.running) < cfg.max_running_requests
            delay = base_s + per_req_s * (len(self.running) + admitted * prefill_cost)
            # sleep(0) still yields: in the instant mode handlers queue more, served as one batch.
            await asyncio.sleep(delay)
            if not self._step() and delay == 0 and not admitted:
                await self._wakeup.wait()  # only hung requests left in the instant mode: no spinning

    def _admit(self) -> int:
        """Admit what fits; returns the prompt tokens admitted (this step prefills them)."""
        now, admitted = self._account(), 0
        while self.waiting and len(self.running) < self.config.max_running_requests:
            req = next(iter(self.waiting))
            # An empty batch always takes the head request, so no prompt blocks the queue forever; the
            # sim never retracts: running requests may grow past the budget, delaying admissions.
            if self.running and self.used_tokens + req.prompt_tokens > self.config.max_total_num_tokens:
                break
            del self.waiting[req]
            self.running[req] = None
            self.used_tokens += req.prompt_tokens
            self._count("prompt_tokens", req.prompt_tokens, req.prompt_tokens * req.stream)
            admitted += req.prompt_tokens
            self.stats["first_admit"] = self.stats["first_admit"] or now
            self.stats["max_running"] = max(self.stats["max_running"], len(self.running))
        self._left_out = len(self.waiting)
        return admitted

    def _step(self) -> bool:
        """Advance every running request by one step; True if anything changed."""
        now, st, produced, streamed, before = self._account(), self.stats, 0, 0, len(self.running)
        for req in list(self.running):
            limit = min([req.target, *(x for x in (req.hang_at, req.drop_at) if x is not None)])
            grew = min(req.generated + self.config.tokens_per_step, limit) - req.generated
            req.generated += grew
            produced += grew
            streamed += grew * req.stream
            self.used_tokens += grew
            if req.generated >= req.target:
                self._end(req, "stop" if req.natural_tokens <= req.max_new_tokens else "length")
                self._count("finished_requests", 1, req.stream)
                st["last_finish"] = now
                st["generated_by_key"][req.key] = st["generated_by_key"].get(req.key, 0) + 1
            elif req.drop_at is not None and req.generated >= req.drop_at:
                self.abort(req, dropped=True)
            elif grew and req.stream:
                req.event.set()
        self._count("generated_tokens", produced, streamed)
        if now - self._tp_since >= 1.0:
            self.last_gen_throughput = (self.totals["generated_tokens"] - self._tp_tokens) / (now - self._tp_since)
            self._tp_since, self._tp_tokens = now, self.totals["generated_tokens"]
        self.stepped_running = len(self.running)
        self.stepped_waiting = min(self._left_out, len(self.waiting))  # less any aborted meanwhile
        return produced > 0 or len(self.running) < before
