"""What an engine holds: leased batches, their prompts, and its claims, which keep two live engines off one
prompt (the holder claims ahead of its free slots, idle engines steal from the back); exactly once is RECORD's."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from genq.core import scripts
from genq.core.ledger import leasing
from genq.core.records import BatchRef, JobConfig, Prompt
from genq.worker.server import Progress

SPEED_ALPHA = 0.05  # weight of each completion in the moving averages of per-request speed


@dataclass(eq=False)
class HeldBatch:
    ref: BatchRef
    token: str  # the lease it was taken under (TAKE)
    config: JobConfig
    size: int
    unfinished: set[str]
    completing: bool = False
    dropped: bool = False  # superseded, done elsewhere or handed back: send nothing more
    borrowed: bool = False  # prompts of another engine's batch: sent and recorded here, no shard written
    prompts: list[Prompt] = field(default_factory=list)


@dataclass(eq=False)
class Task:
    """One prompt of a held batch, from its first send to its outcome."""

    prompt: Prompt
    batch: HeldBatch
    attempts: int = 0  # failed requests here: max_attempts counts these
    lost: int = 0  # tries lost before: claims of it that ended without an outcome
    crashes: int = 0  # server crashes while this prompt was in flight
    last_outage: int = 0  # the outage (ServerWatch.outages) last counted for it
    failing_since: float | None = None  # when its first failed request here was sent (monotonic)
    answered_before: float = 0.0  # Dispatcher.answered when its latest request was sent
    progress: Progress = field(default_factory=Progress)
    cancel_reason: str | None = None

    def crashed(self, outage: int) -> None:
        """The server went down with this prompt in flight: one more crash, once per outage."""
        if self.last_outage != outage:
            self.last_outage = outage
            self.crashes += 1


class Holdings(dict[BatchRef, HeldBatch]):
    """The batches an engine leases now, by (job, batch); and those it borrowed prompts of."""

    def __init__(self) -> None:
        super().__init__()
        self.borrowed: dict[BatchRef, HeldBatch] = {}

    def jobs(self) -> set[str]:
        return {ref.job for ref in self}

    def all_jobs(self) -> set[str]:
        return self.jobs() | {ref.job for ref in self.borrowed}

    def active(self) -> bool:
        return bool(self or self.borrowed)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Claims:
    """The claim scripts, for one engine instance."""

    def __init__(self, conn: aioredis.Redis, instance: str) -> None:
        self.conn, self.instance = conn, instance
        self._claim = conn.register_script(scripts.CLAIM)
        self._steal = conn.register_script(scripts.STEAL)
        self._unclaim = conn.register_script(scripts.UNCLAIM)

    async def claim(self, held: HeldBatch, ids: list[str]) -> tuple[str, dict[int, int]] | None:
        """One letter per id (see CLAIM) and the tries lost on claimed ones, by position; None once
        the batch is done; "" if this lease does not drive the batch now (the lease check tells why)."""
        if not ids:
            return "", {}
        answer = await self._claim(*scripts.claim_call(held.ref, self.instance, held.config.incarnation,
                                                       held.token, ids))
        if not isinstance(answer, list):
            return None if _text(answer) == "done" else ("", {})
        lost = answer[1:]
        return _text(answer[0]), {int(lost[i]) - 1: int(lost[i + 1]) for i in range(0, len(lost), 2)}

    async def steal(self, ref: BatchRef, incarnation: str, holder: str, ids_back_first: list[str],
                    n: int) -> dict[str, int]:
        """The ids claimed, each with the tries it had lost."""
        answer = await self._steal(*scripts.steal_call(ref, self.instance, incarnation, holder, ids_back_first, n))
        return {_text(i): int(lost) for i, lost in zip(answer[0], answer[1])} if answer else {}

    async def unclaim(self, held: HeldBatch, ids: Iterable[str] = ()) -> None:
        await self._unclaim(*scripts.unclaim_call(held.ref, self.instance, held.config.incarnation, ids))

    async def mine(self, ref: BatchRef, ids: list[str]) -> list[bool]:
        owners = await leasing.claim_owners(self.conn, ref, ids)
        return [o is not None and _text(o).partition(" ")[0] == self.instance for o in owners]


# The speed shown is the server's generation counter's rate over this window: answers' tokens come
# in waves (vLLM: 0 to 546 tok/s at a steady 500, 2026-12).
COUNTER_WINDOW_S = 5.0
COUNTER_STALE_S = 10.0  # no reading this long (server down, metrics off): fall back to the answers


class RateWindow:
    """Requests/s and tokens/s over the last 30 s as answers end; the server's own tokens/s from its
    generation counter where it has one."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self._events: list[list[int]] = []  # [second, requests, tokens]: per second, not per request
        self.done = self.errors = 0
        self.job_errors: dict[str, int] = {}
        self.token_s: float | None = None  # seconds per output token of one request, moving average
        self.mean_tokens: float | None = None  # output tokens per request, moving average
        # (monotonic, the server's generation counter, running, KV usage): its metrics' readings
        self._counter: list[tuple[float, float, float | None, float | None]] = []
        self._waiting = 0.0  # the server's queue at the last reading

    def error(self, job: str) -> None:
        self.errors += 1
        self.job_errors[job] = self.job_errors.get(job, 0) + 1

    def add(self, tokens: int, latency_s: float | None = None) -> None:
        self.done += 1
        second = int(time.monotonic())
        if not self._events or self._events[-1][0] != second:
            self._events.append([second, 0, 0])
        self._events[-1][1] += 1
        self._events[-1][2] += tokens
        if latency_s is not None and tokens > 0:  # per-request speed (worker/stealing.py)
            a = SPEED_ALPHA
            per_token = latency_s / tokens
            self.token_s = per_token if self.token_s is None else (1 - a) * self.token_s + a * per_token
            self.mean_tokens = tokens if self.mean_tokens is None else (1 - a) * self.mean_tokens + a * tokens

    def counted(self, at: float, total: float, running: float | None, usage: float | None,
                waiting: float | None = None) -> None:
        """A reading of the server's metrics (at `at`, monotonic): its generation counter, running count,
        KV usage, and what waits (SGLang shows 0 running while it prefills: not stopped)."""
        s = self._counter
        if s and at <= s[-1][0]:
            return  # the same reading again
        self._waiting = waiting or 0.0
        if s and total < s[-1][1]:
            s.clear()  # the server restarted: its counter began again
        s.append((at, total, running, usage))
        while len(s) > 2 and at - s[1][0] >= COUNTER_WINDOW_S:
            s.pop(0)  # the oldest kept is the latest at least a window old

    def server_window(self) -> tuple[float, float | None, float | None] | None:
        """The server's tokens/s by its counter over COUNTER_WINDOW_S, with the mean running count and KV
        usage over the same readings; None without two fresh readings."""
        s = self._counter
        if len(s) < 2 or time.monotonic() - s[-1][0] > COUNTER_STALE_S:
            return None
        if s[-1][2] == 0 and not self._waiting and s[-1][1] == s[-2][1]:
            return 0.0, 0.0, s[-1][3]  # it runs nothing, nothing waits, nothing made since: stopped now
        return ((s[-1][1] - s[0][1]) / (s[-1][0] - s[0][0]), _mean([r[2] for r in s[1:]]), _mean([r[3] for r in s[1:]]))

    def rates(self) -> tuple[float, float]:
        now = time.monotonic()
        self._events = [e for e in self._events if now - e[0] <= 30]
        span = max(1.0, min(30.0, now - self.started))
        return sum(e[1] for e in self._events) / span, sum(e[2] for e in self._events) / span


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None
