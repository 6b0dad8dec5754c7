"""What an engine has to send: the backlog not claimed yet (claimed a few at a time as slots free),
claimed prompts, retries, crash suspects, paused jobs' prompts, and those another engine took ("lent")."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator

import redis

from genq.core.ledger import leasing
from genq.core.records import Prompt
from genq.core.redisconn import in_words
from genq.core.words import plural
from genq.worker.held import Claims, HeldBatch, Task

log = logging.getLogger("genq.worker")

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
        waiting: Counter[str] = Counter()
        for held, tasks in eligible:
            waiting[held.ref.job] += len(tasks)
        quota = plan(waiting, n) if plan is not None else [(j, n) for j in waiting]
        claimed: list[Task] = []
        try:
            for job, k in quota:
                for held, tasks in eligible:
                    if held.ref.job == job and k > 0 and tasks:
                        k -= await self._claim_from(held, tasks, min(k, n - len(claimed)), claimed)
        except (redis.RedisError, OSError) as exc:
            if time.monotonic() >= self._next_claim_note:  # not at every wake: the heartbeat says Redis is away
                log.warning("cannot claim prompts (%s); trying again shortly", in_words(exc))
                self._next_claim_note = time.monotonic() + CLAIM_NOTE_EVERY_S
            asyncio.get_running_loop().call_later(1.0, self.wake.set)
            return
        self.ready.extend(claimed)

    async def _claim_from(self, held: HeldBatch, tasks: deque[Task], k: int, out: list[Task]) -> int:
        if k <= 0:
            return 0
        chunk = [tasks.popleft() for _ in range(min(k, len(tasks)))]
        try:
            out += await self._sort(held, chunk)
        except BaseException:  # Redis away, or cancelled: keep every prompt (a claim of ours is re-claimable)
            tasks.extendleft(reversed(chunk))
            for task in reversed(out):
                self.waiting.setdefault(task.batch, deque()).appendleft(task)
            out.clear()
            raise
        if not tasks:
            self.waiting.pop(held, None)
        return len(chunk)

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
        """After each heartbeat: claims other engines took while this one was frozen (lent if ours, else
        forgotten), and lent prompts that came back."""
        by_batch: dict[HeldBatch, list[Task]] = {}
        for task in self.claimed():
            by_batch.setdefault(task.batch, []).append(task)
        lost: set[Task] = set()
        for held, tasks in by_batch.items():
            mine = await self.claims.mine(held.ref, [t.prompt.id for t in tasks])
            lost.update(t for t, ok in zip(tasks, mine) if not ok)
        if lost:
            log.info("%s taken by other engines meanwhile: not sending them",
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
            got = await self._sort(held, list(lent.values()))  # what stays lent is lent again
            for task in got:
                lent.pop(task.prompt.id, None)
            back += got
        self.ready.extendleft(reversed(back))
        self.wake.set()

    async def prune(self) -> None:
        """Held back, this engine hears of no backlog prompt faster engines finished: it looks (read only)."""
        for held, tasks in [(h, t) for h, t in self.waiting.items() if t and not h.dropped]:
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
        # In place: a coroutine may hold these lists across an await (a CLAIM call's answer is
        # added to `ready` after it); a new list in their place took such prompts with the old one.
        for queue in (self.ready, self.suspects):
            kept = [t for t in queue if not gone(t)]
            queue.clear()
            queue.extend(kept)
        self.delayed = [d for d in self.delayed if not gone(d[2])]
        heapq.heapify(self.delayed)
        for job, tasks in self.parked.items():
            self.parked[job] = [t for t in tasks if not gone(t)]
