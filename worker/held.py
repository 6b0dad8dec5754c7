"""What an engine holds: leased batches, their prompts, and its claims, which keep two live engines off one
prompt (the holder claims ahead of its free slots, idle engines steal from the back); exactly once is RECORD's.
Todo, what it has to send: the backlog not claimed yet, claimed prompts, retries, crash suspects, paused jobs'
prompts, and those another engine took ("lent")."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis

from genq.core import scripts
from genq.core.ledger import leasing
from genq.core.records import BatchRef, JobConfig, Prompt, Result
from genq.core.redisconn import in_words
from genq.core.words import plural
from genq.worker.server import Progress

log = logging.getLogger("genq.worker")

SPEED_ALPHA = 0.05  # weight of each completion in the moving averages of per-request speed


@dataclass(eq=False)
class HeldBatch:
    ref: BatchRef
    token: str  # the lease it was taken under (TAKE); borrowed: the holder's its prompts were stolen under
    config: JobConfig
    unfinished: set[str]
    completing: bool = False
    dropped: bool = False  # superseded, done elsewhere or handed back: send nothing more
    borrowed: bool = False  # prompts of another engine's batch: sent and recorded here, no shard written
    prompts: list[Prompt] = field(default_factory=list)  # empty if its input could not be read (input_changed)
    ids: list[str] = field(default_factory=list)  # its prompts' ids, as its batch record lists them
    recorded: dict[str, Result] = field(default_factory=dict)  # results recorded here: if Redis loses one, again


@dataclass(eq=False)
class Task:
    """One prompt of a held batch, from its first send to its outcome."""

    prompt: Prompt
    batch: HeldBatch
    attempts: int = 0  # failed requests here: max_attempts counts these, less the busy ones
    busy: int = 0  # of those, refused with 429 / 503 (the server's load, never the prompt's fault)
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

    def forget(self, held: HeldBatch) -> None:
        """Forget this holding of its batch (leased or borrowed), not a newer one taken or borrowed since."""
        table = self.borrowed if held.borrowed else self
        if table.get(held.ref) is held:
            del table[held.ref]


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
                    n: int) -> tuple[dict[str, int], str]:
        """The ids claimed, each with the tries it had lost, and the lease they were claimed under."""
        answer = await self._steal(*scripts.steal_call(ref, self.instance, incarnation, holder, ids_back_first, n))
        if not answer:
            return {}, ""
        return {_text(i): int(lost) for i, lost in zip(answer[0], answer[1])}, _text(answer[2])

    async def unclaim(self, held: HeldBatch, ids: Iterable[str] = (), token: str | None = None) -> None:
        """Drop this engine's claims made under `token` (the held lease by default), not a newer lease's."""
        await self._unclaim(*scripts.unclaim_call(held.ref, self.instance, held.config.incarnation,
                                                  token or held.token, ids))

    async def mine(self, held: HeldBatch, ids: list[str]) -> list[bool]:
        """Claimed by this engine under the lease it sends them under (a claim under an older lease is void)."""
        owners = await leasing.claim_owners(self.conn, held.ref, ids)
        return [o is not None and _text(o) == f"{self.instance} {held.token}" for o in owners]


CLAIM_NOTE_EVERY_S = 10.0  # while claims fail (Redis away), say so this often
# Which jobs' prompts are claimed first: (waiting per job, n) -> [(job, k)] (Shares.plan).
Plan = Callable[[dict[str, int], int], list[tuple[str, int]]]


class Todo:
    def __init__(self, claims: Claims, finished: Callable[[str, str, list[str]], None]) -> None:
        self.claims = claims
        self.finished = finished  # (job, batch, ids) whose outcome another engine recorded
        self.wake = asyncio.Event()  # there may be something to send (the dispatcher waits on it)
        self.waiting: dict[HeldBatch, deque[Task]] = {}  # the backlog: held prompts no engine claimed yet
        self.lent: dict[HeldBatch, dict[str, Task]] = {}
        self.ready: deque[Task] = deque()
        self.suspects: deque[Task] = deque()  # crash suspects: sent one at a time
        self.parked: dict[str, list[Task]] = {}  # prompts of paused jobs, by job
        self.delayed: list[tuple[float, int, Task]] = []  # retries: (due, seq, task)
        self._seq = itertools.count()
        self._let_go: dict[HeldBatch, set[str]] = {}  # claimed prompts of let-go batches: their claims go
        self._next_claim_note = 0.0

    def add(self, held: HeldBatch, prompts: list[Prompt]) -> None:
        self.waiting.setdefault(held, deque()).extend(Task(p, held) for p in prompts)
        self.wake.set()

    def add_claimed(self, held: HeldBatch, prompts: list[Prompt], lost: dict[str, int]) -> None:
        """Prompts claimed from another engine's batch, with the tries each had lost: sent next."""
        self.ready.extend(Task(p, held, lost=lost.get(p.id, 0)) for p in prompts)
        self.wake.set()

    async def claim(self, n: int, skip_jobs: set[str], plan: Plan | None = None) -> None:
        """Claim up to n prompts of the backlog into `ready`, each job's oldest batch first, as many of
        each job as `plan` says (Redis away: again in a second)."""
        for held in [h for h, tasks in self.waiting.items() if h.dropped or not tasks]:
            self.waiting.pop(held, None)
        eligible = [(h, t) for h, t in self.waiting.items() if h.ref.job not in skip_jobs]
        waiting = Counter(h.ref.job for h, tasks in eligible for _ in tasks)
        quota = plan(waiting, n) if plan is not None else [(j, n) for j in waiting]
        claimed: list[Task] = []
        try:
            for job, k in quota:
                for held, tasks in eligible:
                    if held.ref.job != job or (take := min(k, n - len(claimed), len(tasks))) <= 0:
                        continue
                    chunk = [tasks.popleft() for _ in range(take)]
                    try:
                        claimed += await self._sort(held, chunk)
                    except BaseException:  # Redis away, or cancelled: every prompt kept (our claims are re-claimable)
                        tasks.extendleft(reversed(chunk))
                        for task in reversed(claimed):
                            self.waiting.setdefault(task.batch, deque()).appendleft(task)
                        raise
                    k -= take
                    if not tasks:
                        self.waiting.pop(held, None)
        except (redis.RedisError, OSError) as exc:
            if time.monotonic() >= self._next_claim_note:  # not at every wake: the heartbeat says Redis is away
                log.warning("cannot claim prompts (%s); trying again shortly", in_words(exc))
                self._next_claim_note = time.monotonic() + CLAIM_NOTE_EVERY_S
            asyncio.get_running_loop().call_later(1.0, self.wake.set)
            return
        self.ready.extend(claimed)

    async def _sort(self, held: HeldBatch, chunk: list[Task]) -> list[Task]:
        """CLAIM the chunk: those claimed returned, those another engine holds lent, finished ones told."""
        claimed = await self.claims.claim(held, [t.prompt.id for t in chunk])
        if claimed is None:  # done elsewhere: the lease check drops the batch
            return []
        answer, lost_tries = claimed
        if not answer:  # not this lease's to send now: waiting again until the lease check decides
            lent_now = self.lent.get(held, {})
            self.waiting.setdefault(held, deque()).extendleft(reversed([t for t in chunk
                                                                        if t.prompt.id not in lent_now]))
            return []
        mine, finished = [], []
        lent = self.lent.setdefault(held, {})
        for position, (task, letter) in enumerate(zip(chunk, answer)):
            task.lost = lost_tries.get(position, task.lost)
            if letter == "t":
                lent[task.prompt.id] = task
                continue
            lent.pop(task.prompt.id, None)
            if letter == "c":
                mine.append(task)
            else:
                finished.append(task.prompt.id)
        if not lent:
            self.lent.pop(held, None)
        if finished:
            self.finished(held.ref.job, held.ref.batch, finished)
        return mine

    async def check_claims(self) -> None:
        """After each heartbeat: claims others took while this one was frozen, or void under the lease it holds now
        (lent if ours: claimed again), lent prompts back."""
        by_batch: dict[HeldBatch, list[Task]] = {}
        for task in self.claimed():
            by_batch.setdefault(task.batch, []).append(task)
        lost: set[Task] = set()
        for held, tasks in by_batch.items():
            mine = await self.claims.mine(held, [t.prompt.id for t in tasks])
            lost.update(t for t, ok in zip(tasks, mine) if not ok)
        if lost:
            log.info("%s taken by other engines meanwhile, or under an older lease: not sending them",
                     plural(len(lost), "claimed prompt was", "claimed prompts were"))
            self._remove(lambda t: t in lost)
        for task in lost:
            if task.batch.borrowed:
                task.batch.unfinished.discard(task.prompt.id)
            else:
                self.lent.setdefault(task.batch, {})[task.prompt.id] = task
        back: list[Task] = []
        for held, lent in list(self.lent.items()):
            if held.dropped:
                self.lent.pop(held)
                continue
            back += await self._sort(held, list(lent.values()))  # those claimed leave `lent`
        self.ready.extendleft(reversed(back))
        self.wake.set()

    async def prune(self) -> None:
        """Held back, this engine hears of no backlog prompt faster engines finished: it looks (read only)."""
        for held, tasks in list(self.waiting.items()):
            if held.dropped or not tasks:  # at its turn: claimed or let go during an earlier look
                continue
            done = set(await leasing.outcome_ids(self.claims.conn, held.ref, [t.prompt.id for t in tasks]))
            if done:
                kept = [t for t in tasks if t.prompt.id not in done]
                tasks.clear()
                tasks.extend(kept)
                self.finished(held.ref.job, held.ref.batch, sorted(done))

    async def give_back_ready(self, server_down: bool = False) -> int:
        """Holding back: own claimed prompts never sent go back to the backlog's front, unclaimed (server down:
        retried ones too, crash suspects aside); how many."""
        mine = [t for t in itertools.chain(self.ready, (d[2] for d in self.delayed) if server_down else ())
                if not t.batch.borrowed and not t.batch.dropped]
        back = mine if server_down else [t for t in mine if not t.attempts and not t.crashes and not t.lost]
        if not back:
            return 0
        gone = set(back)
        self._remove(lambda t: t in gone)  # before the await: the dispatcher sends none of them meanwhile
        by_batch: dict[HeldBatch, list[Task]] = {}
        for task in back:
            by_batch.setdefault(task.batch, []).append(task)
        for held, tasks in by_batch.items():
            self.waiting.setdefault(held, deque()).extendleft(reversed(tasks))
        for held, tasks in by_batch.items():  # after: none is lost to an error meanwhile
            await self.claims.unclaim(held, [t.prompt.id for t in tasks])
        return len(back)

    def let_go(self, task: Task) -> None:
        """A claimed prompt of a let-go batch: its claim goes at the dispatcher's next turn."""
        self._let_go.setdefault(task.batch, set()).add(task.prompt.id)
        self.wake.set()

    async def release_let_go(self) -> None:
        pending, self._let_go = self._let_go, {}
        for held, ids in pending.items():
            try:
                await self.claims.unclaim(held, ids)
            except (redis.RedisError, OSError):  # Redis away: again shortly
                self._let_go.setdefault(held, set()).update(ids)
                asyncio.get_running_loop().call_later(1.0, self.wake.set)

    def remove_batch(self, held: HeldBatch) -> list[str]:
        """Forget the batch's unsent prompts; the ids that were claimed here (their claims can go)."""
        self.waiting.pop(held, None)
        self.lent.pop(held, None)
        unsent = [t.prompt.id for t in self.claimed() if t.batch is held]
        self._remove(lambda t: t.batch is held)
        return unsent

    def adopt(self, borrowed: HeldBatch, held: HeldBatch, running: Iterator[Task]) -> set[str]:
        """This engine now leases a batch it had borrowed prompts of: they become the batch's."""
        adopted = set()
        for task in itertools.chain(self.claimed(), running):
            if task.batch is borrowed:
                task.batch = held
                adopted.add(task.prompt.id)
        borrowed.dropped = True
        return adopted

    def retry_at(self, due: float, task: Task) -> None:
        heapq.heappush(self.delayed, (due, next(self._seq), task))

    def claimed(self) -> Iterator[Task]:
        yield from itertools.chain(self.ready, self.suspects, (d[2] for d in self.delayed), *self.parked.values())

    def __len__(self) -> int:
        return len(self.ready) + len(self.delayed) + len(self.suspects) + sum(len(t) for t in self.waiting.values())

    def by_job(self) -> dict[str, int]:
        return Counter(t.batch.ref.job for t in itertools.chain(
            self.ready, self.suspects, (d[2] for d in self.delayed), *self.waiting.values()))

    def _remove(self, gone: Callable[[Task], bool]) -> None:
        # In place: a coroutine may hold these lists across an await (a CLAIM's answer joins `ready` after it).
        for queue in (self.ready, self.suspects):
            kept = [t for t in queue if not gone(t)]
            queue.clear()
            queue.extend(kept)
        self.delayed = [d for d in self.delayed if not gone(d[2])]
        heapq.heapify(self.delayed)
        for job, tasks in self.parked.items():
            self.parked[job] = [t for t in tasks if not gone(t)]


# The speed shown is the server's generation counter's rate over this window: answers' tokens come in waves
# (vLLM: 0 to 546 tok/s at a steady 500).
COUNTER_WINDOW_S = 5.0
COUNTER_STALE_S = 10.0  # no reading this long (server down, metrics off): fall back to the answers


class RateWindow:
    """Requests/s and tokens/s over the last 30 s; the server's own tokens/s by its generation counter."""

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
        if latency_s is not None and tokens > 0:  # per-request speed (worker/intake.py)
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
