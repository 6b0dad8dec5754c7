"""What an engine has to send: claimed prompts in order, retries, crash suspects, paused
jobs' prompts, and the backlog of held prompts not claimed yet (worker/claims.py).

The dispatcher (worker/dispatch.py) takes from here; leases, stealing and the lease
check put prompts in and take them out.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator

import redis

from genq.core.records import Prompt
from genq.core.refusals import in_words
from genq.core.words import plural
from genq.worker.claims import Backlog
from genq.worker.held import HeldBatch, Task

log = logging.getLogger("genq.worker")

CLAIM_NOTE_EVERY_S = 10.0  # while claims fail (Redis away), say so this often


class Todo:
    def __init__(self, backlog: Backlog, wake: Callable[[], None]) -> None:
        self.backlog = backlog  # held prompts not claimed yet: claimed a few at a time, as slots free
        self.wake = wake
        self.ready: deque[Task] = deque()
        self.suspects: deque[Task] = deque()  # crash suspects: sent one at a time
        self.parked: dict[str, list[Task]] = {}  # prompts of paused jobs, by job
        self.delayed: list[tuple[float, int, Task]] = []  # retries: (due, seq, task)
        self._seq = itertools.count()
        # Claimed prompts of let-go batches that will not be sent here: their claims go.
        self._let_go: dict[HeldBatch, set[str]] = {}
        self._next_claim_note = 0.0
        # Which jobs' prompts are claimed first (worker/shares.py Shares.plan); None: oldest batch first.
        self.plan: Callable[[dict[str, int], int], list[tuple[str, int]]] | None = None

    def add(self, held: HeldBatch, prompts: list[Prompt]) -> None:
        """A leased batch's prompts: claimed as slots free."""
        self.backlog.add(held, [Task(p, held) for p in prompts])
        self.wake()

    def add_claimed(self, held: HeldBatch, prompts: list[Prompt], lost: dict[str, int]) -> None:
        """Prompts already claimed (taken from another engine's batch), with the tries each had lost: sent next."""
        self.ready.extend(Task(p, held, lost=lost.get(p.id, 0)) for p in prompts)
        self.wake()

    def send_soon(self, tasks: list[Task]) -> None:
        """Claimed prompts (lent ones that came back): sent next."""
        self.ready.extendleft(reversed(tasks))
        self.wake()

    async def claim(self, n: int, skip_jobs: set[str]) -> None:
        """Claim up to n prompts of the backlog into `ready` (Redis away: again in a second)."""
        try:
            claimed = await self.backlog.claim(n, skip_jobs, self.plan)
        except (redis.RedisError, OSError) as exc:
            if time.monotonic() >= self._next_claim_note:  # not at every wake: the heartbeat says Redis is away
                log.warning("cannot claim prompts (%s); trying again shortly", in_words(exc))
                self._next_claim_note = time.monotonic() + CLAIM_NOTE_EVERY_S
            asyncio.get_running_loop().call_later(1.0, self.wake)
            return
        self.ready.extend(claimed)

    async def give_back_ready(self, server_down: bool = False) -> int:
        """Holding back (worker/tail.py): the claimed prompts of this engine's own batches that were
        never sent go back to the front of the backlog and their claims are dropped, so that faster
        engines take them (worker/stealing.py); claimed again here if the hold ends first. Those
        that failed before or were borrowed stay, unless the server is down: then every one goes,
        retries too, but the crash suspects (sent alone here, to find the prompt that crashes it).
        Returns how many went back."""
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
            self.backlog.waiting.setdefault(held, deque()).extendleft(reversed(tasks))
        for held, tasks in by_batch.items():
            await self.backlog.claims.unclaim(held, [t.prompt.id for t in tasks])
        return len(back)

    def let_go(self, task: Task) -> None:
        """A claimed prompt of a let-go batch (done or leased elsewhere, handed back) that will not
        be sent (again) here: its claim goes at the dispatcher's next turn (release_let_go)."""
        self._let_go.setdefault(task.batch, set()).add(task.prompt.id)
        self.wake()

    async def release_let_go(self) -> None:
        pending, self._let_go = self._let_go, {}
        for held, ids in pending.items():
            try:
                await self.backlog.claims.unclaim(held, ids)
            except (redis.RedisError, OSError):  # Redis away: again shortly
                self._let_go.setdefault(held, set()).update(ids)
                asyncio.get_running_loop().call_later(1.0, self.wake)

    def retry_at(self, due: float, task: Task) -> None:
        heapq.heappush(self.delayed, (due, next(self._seq), task))

    def claimed(self) -> Iterator[Task]:
        """Prompts this engine claimed and has not sent (or will send again)."""
        yield from itertools.chain(self.ready, self.suspects, (d[2] for d in self.delayed),
                                   *self.parked.values())

    def __len__(self) -> int:
        return len(self.ready) + len(self.delayed) + len(self.suspects) + len(self.backlog)

    def by_job(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for task in itertools.chain(self.ready, self.suspects, (d[2] for d in self.delayed), self.backlog.tasks()):
            out[task.batch.ref.job] = out.get(task.batch.ref.job, 0) + 1
        return out

    def adopt(self, borrowed: HeldBatch, held: HeldBatch, running: Iterator[Task]) -> set[str]:
        """This engine now leases a batch it had borrowed prompts of: they become the batch's."""
        adopted = set()
        for task in itertools.chain(self.claimed(), running):
            if task.batch is borrowed:
                task.batch = held
                adopted.add(task.prompt.id)
        borrowed.dropped = True
        return adopted

    def remove_batch(self, held: HeldBatch) -> list[str]:
        """Forget the batch's unsent prompts; the ids that were claimed here (their claims can go)."""
        self.backlog.drop(held)
        unsent = [t.prompt.id for t in self.claimed() if t.batch is held]
        self._remove(lambda t: t.batch is held)
        return unsent

    async def check_claims(self) -> None:
        """After each heartbeat: claims lost while frozen, and lent prompts that came back."""
        await self.verify_claims()
        self.send_soon(await self.backlog.recheck())

    async def verify_claims(self) -> None:
        """Claimed prompts another engine took meanwhile (this one was frozen and looked
        dead): lent if the batch is ours, forgotten if borrowed."""
        by_batch: dict[HeldBatch, list[Task]] = {}
        for task in self.claimed():
            by_batch.setdefault(task.batch, []).append(task)
        lost: set[Task] = set()
        for held, tasks in by_batch.items():
            mine = await self.backlog.claims.mine(held.ref, [t.prompt.id for t in tasks])
            lost.update(t for t, ok in zip(tasks, mine) if not ok)
        if not lost:
            return
        log.info("%s taken by other engines meanwhile: not sending them",
                 plural(len(lost), "claimed prompt was", "claimed prompts were"))
        self._remove(lambda t: t in lost)
        for task in lost:
            if task.batch.borrowed:
                task.batch.unfinished.discard(task.prompt.id)
            else:
                self.backlog.lend(task)

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
