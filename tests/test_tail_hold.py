"""worker/intake.py: the slow worker's hold comes when the fleet's unsent prompts cross the line, not
a beat or two later, and what it had claimed ahead goes to the faster workers.

bench/fleet_tail.py --trace (2026-12-03) saw the half-speed server take its last prompt 1.2-1.6 s
after the unsent prompts fell to the line: the hold was judged on heartbeat counts up to a beat old,
once a second, and the prompts it had claimed ahead were still sent after it.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from genq.core import keys
from genq.core.records import BatchRef, JobConfig, Prompt, WorkerStatus, pack
from genq.worker.held import Claims, HeldBatch, Task, Todo
from genq.worker.intake import hold_back


def status(name: str, token_s: float, queued: int, beat_age_s: float = 0.0) -> WorkerStatus:
    return WorkerStatus(name=name, host="h", pid=1, server="s", state="busy", started_at=0,
                        heartbeat_at=time.time() - beat_age_s, concurrency_target=16, in_flight=16, queued=queued,
                        token_s=token_s, mean_tokens=256)


def test_a_beat_old_count_is_taken_less_what_was_sent_since():
    # Three workers at 3 ms/token (16 slots, 0.77 s requests: ~21 sent a second each), one at 6:
    # the line is SPREAD x 3 x 16 = 144 unsent prompts.
    slow = status("slow", 0.006, 10)
    now = [status(f"f{i}", 0.003, 40) for i in range(3)]
    assert hold_back(slow, now)  # 130 unsent
    beat_ago = [status(f"f{i}", 0.003, 60, beat_age_s=1.0) for i in range(3)]
    # A beat ago they held 60 each; they have sent ~21 each since: ~127 now, under the line.
    assert hold_back(slow, beat_ago)
    assert not hold_back(slow, [status(f"f{i}", 0.003, 80, beat_age_s=1.0) for i in range(3)])  # ~187
    # A clock far off counts two beats at most (~38 each: 3 x 98 + 10 unsent, over the line).
    assert not hold_back(slow, [status(f"f{i}", 0.003, 140, beat_age_s=100.0) for i in range(3)])


def test_holding_back_gives_back_the_prompts_claimed_ahead(redis_url):
    job, ref = "hb", BatchRef("hb", "b0000001")
    config = JobConfig(name=job, output="/tmp", model="m", incarnation="i1")
    own = HeldBatch(ref, "tok", config, set())
    other = HeldBatch(BatchRef(job, "b0000002"), "", config, set(), borrowed=True)
    prompts = [Prompt(id=f"p{i}", index=i, prompt="x") for i in range(6)]

    async def go() -> tuple[int, list[str], list[str], set[str]]:
        conn = aioredis.Redis.from_url(redis_url)
        try:
            await conn.set(keys.job_config(job), pack(config))
            await conn.hset(keys.batch_claims(job, ref.batch), mapping={f"p{i}": "me tok" for i in (0, 1, 2, 4)})
            todo = Todo(Claims(conn, "me"), lambda *a: None)
            todo.add(own, [prompts[5]])  # not claimed yet
            todo.ready.extend([Task(prompts[0], own), Task(prompts[1], own), Task(prompts[2], own, attempts=1),
                               Task(prompts[3], other), Task(prompts[4], own)])
            back = await todo.give_back_ready()
            claims = {k.decode() for k in await conn.hkeys(keys.batch_claims(job, ref.batch))}
            return (back, [t.prompt.id for t in todo.ready], [t.prompt.id for t in todo.waiting[own]], claims)
        finally:
            await conn.aclose()

    back, ready, waiting, claims = asyncio.run(go())
    assert back == 3
    assert ready == ["p2", "p3"]  # a retried prompt keeps its attempts here; a borrowed one is its holder's
    assert waiting == ["p0", "p1", "p4", "p5"]  # first in the backlog, in order: claimed first if the hold ends
    assert claims == {"p2"}  # p0, p1, p4 unclaimed: a faster engine may take them


def test_holding_back_looks_only_at_backlogs_still_there_when_their_turn_comes(redis_url):
    # While the hold is decided the dispatcher may still claim, and a batch be let go: a backlog emptied or
    # dropped during the look at an earlier one is not asked about (an HMGET of no ids is an error).
    job = "pr"
    config = JobConfig(name=job, output="/tmp", model="m", incarnation="i1")
    first, emptied, dropped = (HeldBatch(BatchRef(job, f"b000000{i}"), "tok", config, set()) for i in (1, 2, 3))
    prompts = [Prompt(id=f"p{i}", index=i, prompt="x") for i in range(3)]

    async def go() -> list[tuple[str, list[str]]]:
        conn = aioredis.Redis.from_url(redis_url)
        told: list[tuple[str, list[str]]] = []
        try:
            for held in (first, dropped):  # an outcome recorded elsewhere for each
                await conn.hset(keys.batch_results(job, held.ref.batch), "p0", b"r")
            todo = Todo(Claims(conn, "me"), lambda job, batch, ids: told.append((batch, ids)))
            for held in (first, emptied, dropped):
                todo.add(held, prompts)
            looking = asyncio.create_task(todo.prune())
            await asyncio.sleep(0)  # its look at the first backlog is out
            todo.waiting[emptied].clear()  # the dispatcher claims the last of one meanwhile
            dropped.dropped = True  # and another batch is let go
            todo.remove_batch(dropped)
            await looking
            return told
        finally:
            await conn.aclose()

    assert asyncio.run(go()) == [("b0000001", ["p0"])]
