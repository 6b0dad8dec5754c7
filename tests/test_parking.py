"""worker/gate.py's parking of a paused job: one park at a time per job. Gate.run parks a paused job held
here once its requests in flight are done (`pausing` marks it while that park waits); a batch of the job
that arrives meanwhile is parked by the admission, which must not end that mark, or every second another
park of the job starts and waits on the same requests. That park leaves what the first one lets go to it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import redis.asyncio as aioredis

from genq.core.ledger import jobs as ledger_jobs
from genq.core.records import BatchRef, JobConfig, Prompt
from genq.worker.gate import Gate
from genq.worker.held import HeldBatch, Task
from tests.test_model_change import OLD, engine_parts, queue_job


class Parks:
    """Batches.let_go_job as the gate's park sees it: a paused park waits for its requests in flight (until `done`)."""

    def __init__(self) -> None:
        self.done = asyncio.Event()
        self.waiting = 0  # parks waiting on the requests in flight
        self.arriving = False  # a batch just arrived: nothing of it in flight, its park ends at once

    async def let_go_job(self, job: str, *, cancel: bool, requeue: bool) -> list[str]:
        if self.arriving:
            return []
        self.waiting += 1
        await self.done.wait()
        return []


def test_a_batch_parked_on_arrival_does_not_start_a_second_park_of_its_paused_job(redis_url):
    async def go() -> int:
        conn = aioredis.Redis.from_url(redis_url)
        parks = Parks()
        held = SimpleNamespace(all_jobs=lambda: {"j"})
        batches = SimpleNamespace(let_go_job=parks.let_go_job, conn=conn, sync_conn=None, worker="w", held=held)
        gate = Gate(batches, None, None)  # type: ignore[arg-type]
        gate.paused_jobs = {"j"}
        turns = asyncio.Queue[None]()
        gate.judge_all = lambda: turns.put_nowait(None)  # type: ignore[method-assign]  # a turn of run ended
        running = asyncio.create_task(gate.run())
        try:
            await turns.get()  # the first turn: the paused job's park starts, and waits on its requests
            assert parks.waiting == 1 and gate.pausing == {"j"}
            parks.arriving = True  # a batch of it arrives meanwhile, parked at once by the admission
            await gate.park_job("j", quiet=True, cancel=False)
            parks.arriving = False
            await turns.get()  # the next turn
            return parks.waiting
        finally:
            running.cancel()
            parks.done.set()
            await asyncio.gather(running, *gate._tasks, return_exceptions=True)
            await conn.aclose()

    assert asyncio.run(go()) == 1, "a second park of the paused job started while the first waited"


def test_a_batch_arriving_while_its_paused_job_lets_borrowed_prompts_finish_is_parked_at_once(redis_url, rconn,
                                                                                            tmp_path):
    """The paused job's park lets its borrowed prompts go, one still in flight (it finishes first); a batch of
    the job taken meanwhile is parked by the admission at once: that park leaves the borrowed batch, dropped,
    to the first, as it leaves the held batches the first lets go. Before, it let that batch go a second time
    (its claims dropped again) and waited on its request in flight to end the new batch's lease."""
    (batch,) = queue_job(rconn, "j", tmp_path / "out")

    async def scenario() -> list[str] | None:
        conn = aioredis.Redis.from_url(redis_url)
        held, batches, _, intake = engine_parts(conn, rconn, redis_url)
        config = JobConfig(name="j", output=str(tmp_path / "out"), model=OLD, incarnation="i-j")
        borrowed = held.borrowed[BatchRef("j", "elsewhere")] = HeldBatch(BatchRef("j", "elsewhere"), "", config,
                                                                         {"p"}, borrowed=True)
        task = Task(Prompt(id="p", index=0, messages=[{"role": "user", "content": "x"}]), borrowed)
        answered = asyncio.Event()

        async def in_flight() -> None:
            await answered.wait()
            batches.running.pop(task)

        batches.running[task] = asyncio.create_task(in_flight())
        first = second = asyncio.create_task(batches.let_go_job("j", cancel=False, requeue=False))
        try:
            await asyncio.sleep(0.2)
            assert borrowed.dropped and not first.done(), "the first park waits on the borrowed request"
            assert await intake.take() and list(held) == [BatchRef("j", batch)]
            ledger_jobs.pause(rconn, "j")
            second = asyncio.create_task(batches.let_go_job("j", cancel=False, requeue=False))
            done, _ = await asyncio.wait({second}, timeout=2.0)
            return second.result() if done else None
        finally:
            answered.set()
            await asyncio.gather(first, second, return_exceptions=True)
            batches.close()
            await conn.aclose()

    parked = asyncio.run(scenario())
    assert parked is not None, "the arriving batch's park waited on the borrowed request the first park lets finish"
    assert parked == [f"j/{batch}"]
