"""worker/gate.py's parking of a paused job: one park at a time per job. Gate.run parks a paused job held
here once its requests in flight are done (`pausing` marks it while that park waits); a batch of the job
that arrives meanwhile is parked by the admission, which must not end that mark, or every second another
park of the job starts and waits on the same requests."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import redis.asyncio as aioredis

from genq.worker.gate import Gate


class Parks:
    """Batches.park as the gate sees it: a paused park waits for its requests in flight (until `done`)."""

    def __init__(self) -> None:
        self.done = asyncio.Event()
        self.waiting = 0  # parks waiting on the requests in flight
        self.arriving = False  # a batch just arrived: nothing of it in flight, its park ends at once

    async def park(self, job: str, *, cancel: bool) -> list[str]:
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
        batches = SimpleNamespace(park=parks.park, conn=conn, sync_conn=None, worker="w", held=held)
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
            gate.tripped.set()  # the next turn, now
            await turns.get()
            return parks.waiting
        finally:
            running.cancel()
            parks.done.set()
            await asyncio.gather(running, *gate._tasks, return_exceptions=True)
            await conn.aclose()

    assert asyncio.run(go()) == 1, "a second park of the paused job started while the first waited"
