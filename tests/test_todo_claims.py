"""worker/todo.py: prompts claimed in Redis are never lost from the engine's memory. A batch let go
(parked, blocked, handed back) while a CLAIM call of another batch is out must not take that call's
prompts with it: claimed and never sent, they held their batch open forever (a paused job's
neighbour hung test_scheduling's pause test one run in three)."""

from __future__ import annotations

import asyncio

from genq.core.records import BatchRef, JobConfig, Prompt
from genq.worker.held import HeldBatch, Task
from genq.worker.todo import Todo


def held_batch(job: str) -> HeldBatch:
    return HeldBatch(BatchRef(job, "b0000001"), "t", JobConfig(name=job, output="/tmp", model="m"), 4, set())


class SlowBacklog:
    """A CLAIM call that answers once the test lets it."""

    def __init__(self, tasks: list[Task]) -> None:
        self.tasks = tasks
        self.answer = asyncio.Event()

    def drop(self, held: HeldBatch) -> None:
        pass

    async def claim(self, n: int, skip_jobs: set[str], plan: object = None) -> list[Task]:
        await self.answer.wait()
        return self.tasks


def test_a_batch_let_go_during_a_claim_keeps_the_prompts_that_claim_took():
    kept, parked = held_batch("pb"), held_batch("pa")
    claimed = [Task(Prompt(id=f"p{i}", index=i, prompt="x"), kept) for i in range(4)]
    backlog = SlowBacklog(claimed)

    async def go() -> list[str]:
        todo = Todo(backlog, lambda: None)  # type: ignore[arg-type]
        todo.ready.append(Task(Prompt(id="a0", index=0, prompt="x"), parked))
        call = asyncio.create_task(todo.claim(4, set()))
        await asyncio.sleep(0)  # the CLAIM call is out
        assert todo.remove_batch(parked) == ["a0"]  # the paused job's batch is parked meanwhile
        backlog.answer.set()
        await call
        return [t.prompt.id for t in todo.claimed()]

    assert asyncio.run(go()) == ["p0", "p1", "p2", "p3"]
