"""Claims: one sender per prompt, so prompts can move between engines at the end of a job.

A batch has one lease (its holder) but each prompt is claimed by the engine about to
send it (keys.batch_claims). The holder claims a few prompts ahead of its free slots;
the rest of a batch it holds stays unclaimed, so an engine with idle slots and an empty
queue can take them (worker/stealing.py) from the back of the batch.

A claim is "INSTANCE TOKEN": the engine sending the prompt and the batch's lease it was
taken under. It counts while that lease is the batch's current one and its engine
heartbeats (keys.engine_alive); an outcome recorded for the prompt ends it
(worker/results.py), and a released batch drops them all (ledger RELEASE). So a holder
whose lease was superseded (it froze, the batch went round again) holds nothing up, even
once it beats again: its claims, and those taken from it, are void under the new lease.

A claim taken over from another (its engine stopped beating, its lease is over) is a try
lost: the scripts count it in keys.batch_tries, in the same call, and tell the new sender, so
a record's `attempts` counts it (Task.lost). Only such a take-over touches that hash.

Nothing here weakens exactly once: outcomes are still written once (first writer
wins). Claims only keep two live engines from generating the same prompt.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import redis.asyncio as aioredis

from genq.core import scripts
from genq.core.ledger import leasing
from genq.core.records import BatchRef
from genq.worker.held import HeldBatch, Task


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Claims:
    """The claim scripts, for one engine instance."""

    def __init__(self, conn: aioredis.Redis, instance: str) -> None:
        self.conn = conn
        self.instance = instance
        self._claim = conn.register_script(scripts.CLAIM)
        self._steal = conn.register_script(scripts.STEAL)
        self._unclaim = conn.register_script(scripts.UNCLAIM)

    async def claim(self, held: HeldBatch, ids: list[str]) -> tuple[str, dict[int, int]] | None:
        """One letter per id (see CLAIM) and the tries lost on claimed ones, by position;
        None once the batch is done; "" if this lease does not drive the batch now (the lease
        check then tells what happened)."""
        if not ids:
            return "", {}
        script_keys, args = scripts.claim_call(held.ref, self.instance, held.config.incarnation, held.token, ids)
        answer = await self._claim(keys=script_keys, args=args)
        if not isinstance(answer, list):
            return None if _text(answer) == "done" else ("", {})
        lost = answer[1:]
        return _text(answer[0]), {int(lost[i]) - 1: int(lost[i + 1]) for i in range(0, len(lost), 2)}

    async def steal(self, ref: BatchRef, incarnation: str, holder: str, ids_back_first: list[str],
                    n: int) -> dict[str, int]:
        """The ids claimed, each with the tries it had lost."""
        script_keys, args = scripts.steal_call(ref, self.instance, incarnation, holder, ids_back_first, n)
        answer = await self._steal(keys=script_keys, args=args)
        if not answer:
            return {}
        return {_text(i): int(lost) for i, lost in zip(answer[0], answer[1])}

    async def unclaim(self, held: HeldBatch, ids: Iterable[str] = ()) -> None:
        script_keys, args = scripts.unclaim_call(held.ref, self.instance, held.config.incarnation, ids)
        await self._unclaim(keys=script_keys, args=args)

    async def mine(self, ref: BatchRef, ids: list[str]) -> list[bool]:
        owners = await leasing.claim_owners(self.conn, ref, ids)
        return [o is not None and _text(o).partition(" ")[0] == self.instance for o in owners]


class Backlog:
    """The prompts of held batches that no engine has claimed yet, and those of them
    another engine took ("lent"): their outcomes end the batch like this engine's own."""

    def __init__(self, claims: Claims, on_finished: Callable[[str, str, list[str]], None]) -> None:
        self.claims = claims
        self.on_finished = on_finished  # (job, batch, ids) whose outcome another engine recorded
        self.waiting: dict[HeldBatch, deque[Task]] = {}
        self.lent: dict[HeldBatch, dict[str, Task]] = {}

    def __len__(self) -> int:
        return sum(len(tasks) for tasks in self.waiting.values())

    def tasks(self) -> Iterable[Task]:
        for tasks in self.waiting.values():
            yield from tasks

    def add(self, held: HeldBatch, tasks: list[Task]) -> None:
        self.waiting.setdefault(held, deque()).extend(tasks)

    def lend(self, task: Task) -> None:
        self.lent.setdefault(task.batch, {})[task.prompt.id] = task

    def drop(self, held: HeldBatch) -> None:
        self.waiting.pop(held, None)
        self.lent.pop(held, None)

    async def claim(self, n: int, skip_jobs: set[str],
                    plan: Callable[[dict[str, int], int], list[tuple[str, int]]] | None = None) -> list[Task]:
        """Claim up to n prompts to send, each job's oldest batch first; `plan` (worker/shares.py)
        says how many of each job (priorities, fair share), else the oldest batches first."""
        for held in [h for h, tasks in self.waiting.items() if h.dropped or not tasks]:
            self.waiting.pop(held, None)
        eligible = [(h, t) for h, t in self.waiting.items() if h.ref.job not in skip_jobs]
        waiting: dict[str, int] = {}
        for held, tasks in eligible:
            waiting[held.ref.job] = waiting.get(held.ref.job, 0) + len(tasks)
        quota = plan(waiting, n) if plan is not None else [(j, n) for j in waiting]
        out: list[Task] = []
        for job, k in quota:
            for held, tasks in eligible:
                if held.ref.job == job and k > 0 and tasks:
                    got = await self._claim_from(held, tasks, min(k, n - len(out)), out)
                    k -= got
        return out

    async def _claim_from(self, held: HeldBatch, tasks: deque[Task], k: int, out: list[Task]) -> int:
        """Claim k prompts of one batch into out; how many were taken from its backlog."""
        if k <= 0:
            return 0
        chunk = [tasks.popleft() for _ in range(min(k, len(tasks)))]
        try:
            out += await self._sort(held, chunk)
        except BaseException:  # Redis away, or cancelled: keep every prompt (a claim of ours is re-claimable)
            tasks.extendleft(reversed(chunk))
            for task in reversed(out):
                self.waiting.setdefault(task.batch, deque()).appendleft(task)
            raise
        if not tasks:
            self.waiting.pop(held, None)
        return len(chunk)

    async def recheck(self) -> list[Task]:
        """Lent prompts: finished elsewhere (the batch may now be complete), still taken,
        or back to this engine because the one that took them stopped beating."""
        back: list[Task] = []
        for held, lent in list(self.lent.items()):
            if held.dropped:
                self.lent.pop(held)
                continue
            got = await self._sort(held, list(lent.values()))  # what stays lent is lent again
            for task in got:
                lent.pop(task.prompt.id, None)
            back += got
        return back

    async def _sort(self, held: HeldBatch, chunk: list[Task]) -> list[Task]:
        claimed = await self.claims.claim(held, [t.prompt.id for t in chunk])
        if claimed is None:  # done elsewhere: the lease check drops the batch
            return []
        answer, lost_tries = claimed
        if not answer:  # not this lease's to send now: waiting again until the lease check decides
            self.waiting.setdefault(held, deque()).extendleft(reversed([t for t in chunk if t.prompt.id not in
                                                                        self.lent.get(held, {})]))
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
            self.on_finished(held.ref.job, held.ref.batch, finished)
        return mine
