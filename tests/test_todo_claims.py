"""worker/held.py's Todo: prompts claimed in Redis are never lost from the engine's memory. A batch let go
(parked, blocked, handed back) while a CLAIM call of another batch is out must not take that call's
prompts with it: claimed and never sent, they held their batch open forever (a paused job's
neighbour hung test_scheduling's pause test one run in three)."""

from __future__ import annotations

import asyncio

from genq.core.records import BatchRef, JobConfig, Prompt
from genq.worker.held import HeldBatch, Task, Todo


def held_batch(job: str) -> HeldBatch:
    return HeldBatch(BatchRef(job, "b0000001"), "t", JobConfig(name=job, output="/tmp", model="m"), set())


class SlowClaims:
    """A CLAIM call that answers once the test lets it."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()

    async def claim(self, held: HeldBatch, ids: list[str]) -> tuple[str, dict[int, int]]:
        await self.answer.wait()
        return "c" * len(ids), {}


def test_a_batch_let_go_during_a_claim_keeps_the_prompts_that_claim_took():
    kept, parked = held_batch("pb"), held_batch("pa")
    claims = SlowClaims()

    async def go() -> list[str]:
        todo = Todo(claims, lambda *a: None)  # type: ignore[arg-type]
        todo.add(kept, [Prompt(id=f"p{i}", index=i, prompt="x") for i in range(4)])
        todo.ready.append(Task(Prompt(id="a0", index=0, prompt="x"), parked))
        call = asyncio.create_task(todo.claim(4, set()))
        await asyncio.sleep(0)  # the CLAIM call is out
        assert todo.remove_batch(parked) == ["a0"]  # the paused job's batch is parked meanwhile
        claims.answer.set()
        await call
        return [t.prompt.id for t in todo.claimed()]

    assert asyncio.run(go()) == ["p0", "p1", "p2", "p3"]
