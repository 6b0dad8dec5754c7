"""A server that now serves another model: its batches are handed back once, and nothing of a job of the old
model is taken again afterwards (worker/gate.py's ServerWatch, worker/intake.py's skip list); a batch taken (or
borrowed) again while a hand-back ends stays held (worker/batches.py). The engine's parts in this process against
the real test Redis; the server is a stand-in that only tells its model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import redis
import redis.asyncio as aioredis

from genq.core import keys
from genq.core.ledger import lease_holder, lease_token
from genq.core.queueing import new_batches, save_config, write_batches
from genq.core.records import BatchRef, JobConfig, Prompt
from genq.worker import intake as intake_mod
from genq.worker.batches import Batches
from genq.worker.controller import Running
from genq.worker.engines import SGLANG, ServerInfo
from genq.worker.gate import ServerWatch
from genq.worker.held import Holdings
from genq.worker.intake import Intake, Shares, Stealer
from genq.worker.options import WorkerOptions

OLD, NEW = "old-model", "new-model"


class _Dispatcher:
    """What the intake reads of the dispatcher: the watch, and that it takes work."""

    def __init__(self, watch: ServerWatch) -> None:
        self.watch = watch

    def accepting(self) -> bool:
        return True


class _Server:
    """A server that now serves NEW."""

    async def discover(self) -> ServerInfo:
        return ServerInfo(SGLANG, model=NEW)


class _Controller:
    def set_capacity(self, capacity: int | None) -> None:
        pass


class _Running:
    requested = 0


def engine_parts(conn: aioredis.Redis, rconn: redis.Redis, redis_url: str, server: _Server | None = None
                 ) -> tuple[Holdings, Batches, ServerWatch, Intake]:
    """An engine's holdings, Batches, ServerWatch (its server serving OLD) and Intake, built as engine.py builds
    them; the watch gets a server, controller and stop flag only where its recovery loop runs (`server`)."""
    held = Holdings()
    batches = Batches(conn, rconn, "w", "w.1", held, Running())
    opts = WorkerOptions(redis_url=redis_url, server_url="http://127.0.0.1:1")
    parts = (server, _Controller(), _Running()) if server is not None else (None, None, None)
    watch = ServerWatch(opts, *parts, batches)  # type: ignore[arg-type]
    watch.info = ServerInfo(SGLANG, model=OLD)
    intake = Intake(opts, batches, _Dispatcher(watch), Shares(conn, "q", "w.1", batches))  # type: ignore[arg-type]
    return held, batches, watch, intake


def queue_job(conn: redis.Redis, job: str, output: Path, batches: int = 1) -> list[str]:
    """Batches of two prompts for `job`, a job of OLD, queued as `genq enqueue` queues them; their ids."""
    save_config(conn, JobConfig(name=job, output=str(output), model=OLD, incarnation="i-" + job))
    prompts = [Prompt(id=f"{job}-{i}", index=i, messages=[{"role": "user", "content": "x"}])
               for i in range(2 * batches)]
    made = new_batches(conn, job, prompts, 2)
    with conn.pipeline(transaction=True) as pipe:
        write_batches(pipe, conn, made, {})
        pipe.execute()
    return [b.id for b in made]


def test_a_batch_handed_back_for_another_model_is_not_taken_again(redis_url: str, rconn: redis.Redis,
                                                                   tmp_path: Path, monkeypatch) -> None:
    """The watch hands a held batch back when the server serves another model; the intake's next look at the
    queue leaves it there, though its view of the jobs' models was read under the old model just before (its
    refresh interval made long: no clock decides this). Before, the intake took it again and its model gate
    handed it back once more: a second hand-back and a second RQ job for nothing."""
    monkeypatch.setattr(intake_mod, "FOREIGN_EVERY_S", 3600.0)
    (batch,) = queue_job(rconn, "j", tmp_path / "out")

    async def scenario() -> tuple[bool, bytes | None, bytes | None, int]:
        conn = aioredis.Redis.from_url(redis_url)
        held, batches, watch, intake = engine_parts(conn, rconn, redis_url)
        try:
            assert await intake.take() and [ref.batch for ref in held] == [batch]
            watch.info = ServerInfo(SGLANG, model=NEW)  # as ServerWatch.recovery_loop adopts the new server
            await batches.hand_back_all(f"server now serves {NEW}")
            carrier = rconn.hget(keys.job_transport("j"), batch)
            taken = await intake.take()
            return taken, carrier, rconn.hget(keys.job_transport("j"), batch), batches.handed_back
        finally:
            batches.close()
            await conn.aclose()

    taken, carrier, after, handed_back = asyncio.run(scenario())
    assert handed_back == 1 and carrier is not None
    assert not taken, "the batch of the old model's job was taken again (and handed back by the model gate)"
    assert after == carrier, "a second RQ job carries the batch: it was handed back twice"
    assert rconn.hlen(keys.job_leases("j")) == 0


def test_a_batch_taken_while_the_watch_hands_back_for_another_model_is_not_admitted(
        redis_url: str, rconn: redis.Redis, tmp_path: Path) -> None:
    """A TAKE the intake had under way when the watch saw the new model lands while the watch hands the held
    batches back (injected: it runs inside the hand-back, where the hand-back waits for what was recorded). The
    batch it takes is judged by the server as it is now: handed back, not admitted and later sent to the new
    model; nothing of the job stays held here. Before, the watch adopted the new model only after its
    hand-back, so that batch was admitted for the old one."""
    first, second = queue_job(rconn, "j", tmp_path / "out", batches=2)

    async def scenario() -> tuple[bool, list[str], bool]:
        conn = aioredis.Redis.from_url(redis_url)
        held, batches, watch, intake = engine_parts(conn, rconn, redis_url, _Server())
        wait_idle, meanwhile = batches.writer.wait_idle, []

        async def take_meanwhile() -> None:
            if not meanwhile:
                meanwhile.append(await intake.take())
            await wait_idle()

        batches.writer.wait_idle = take_meanwhile  # type: ignore[method-assign]
        recovery = asyncio.create_task(watch.recovery_loop(batches.hand_back_all))
        try:
            assert await intake.take() and [ref.batch for ref in held] == [first]
            watch._went_down("a test: the server answers under another name")
            for _ in range(600):  # the loop's first look is half a second away
                if not watch.down:
                    break
                await asyncio.sleep(0.05)
            assert not watch.down and meanwhile, "the recovery loop never took the new server"
            return meanwhile[0], [ref.batch for ref in held], batches.arrived.qsize() > 1
        finally:
            recovery.cancel()
            batches.close()
            await conn.aclose()

    _, still_held, admitted = asyncio.run(scenario())
    assert still_held == [], f"batch {still_held} of the old model's job is held, to be sent to {NEW}"
    assert not admitted, "a batch of the old model's job was admitted after the change was seen"
    assert rconn.hlen(keys.job_leases("j")) == 0
    assert {b.decode() for b in rconn.hkeys(keys.job_transport("j"))} == {first, second}


def test_a_batch_taken_again_while_its_hand_back_ends_stays_held(redis_url: str, rconn: redis.Redis, tmp_path: Path,
                                                                  monkeypatch) -> None:
    """The watch hands its batches back (the server down too long); a TAKE the intake had under way takes the
    batch again the moment its lease ends (injected: right after the hand-back's end of the lease) and loads it.
    The hand-back then forgets the batch it let go, not the one just loaded under the new lease: that one stays
    held. Before, it was popped: leased to this live engine in Redis, driven by nothing."""
    from genq.worker import batches as batches_mod

    (batch,) = queue_job(rconn, "j", tmp_path / "out")

    async def scenario() -> tuple[list[str], str | None]:
        conn = aioredis.Redis.from_url(redis_url)
        held, batches, _, intake = engine_parts(conn, rconn, redis_url)
        real = batches_mod.retrying

        async def then_taken(action, what: str = "redis"):
            answer = await real(action, what)
            if what.startswith("ending the lease"):
                assert await intake.take(), "the batch handed back was not taken again"
            return answer

        monkeypatch.setattr(batches_mod, "retrying", then_taken)
        try:
            assert await intake.take()
            await batches.hand_back_all("server down for 300s")
            return [ref.batch for ref in held], next(iter(held.values())).token if held else None
        finally:
            batches.close()
            await conn.aclose()

    still_held, token = asyncio.run(scenario())
    lease = rconn.hget(keys.job_leases("j"), batch)
    assert lease is not None and lease_holder(lease) == "w.1", lease
    assert still_held == [batch], "the batch leased to this engine again is held by nothing here"
    assert token == lease_token(lease)


def test_prompts_borrowed_again_while_their_give_back_ends_stay_borrowed(redis_url: str, rconn: redis.Redis,
                                                                        tmp_path: Path, monkeypatch) -> None:
    """The borrowed case of the test above: prompts this engine borrowed from another's batch are given back,
    and the stealer borrows from that batch again right after the give-back released their claims (injected).
    The give-back forgets the borrowed batch it let go, not the new one, whose prompts are queued here to send;
    a give-back with nothing borrowed meanwhile forgets it. Before, the new one was popped: its prompts were
    sent, their outcomes recorded, by a batch the engine no longer knew it borrowed."""
    from genq.worker import batches as batches_mod

    (batch,) = queue_job(rconn, "j", tmp_path / "out")
    ref = BatchRef("j", batch)
    config = JobConfig(name="j", output=str(tmp_path / "out"), model=OLD, incarnation="i-j")
    prompts = [Prompt(id="j-1", index=1, messages=[{"role": "user", "content": "x"}])]

    async def scenario() -> tuple[bool, bool, bool]:
        conn = aioredis.Redis.from_url(redis_url)
        held, batches, _, _ = engine_parts(conn, rconn, redis_url)
        stealer = Stealer("q", batches, SimpleNamespace(gate=None), None)  # type: ignore[arg-type]
        real = batches_mod.retrying

        async def then_borrowed(action, what: str = "redis"):
            answer = await real(action, what)
            if what.startswith("releasing claims") and held.borrowed.get(ref) is first:  # it was let go
                stealer._borrow(ref, config, prompts, {"j-1": 0}, "lease-1")
            return answer

        stealer._borrow(ref, config, prompts, {"j-1": 0}, "lease-1")
        first = held.borrowed[ref]
        monkeypatch.setattr(batches_mod, "retrying", then_borrowed)
        try:
            await batches.give_back_borrowed("a test")
            again = held.borrowed.get(ref)
            kept = (again is not None and again is not first and not again.dropped
                    and any(t.batch is again for t in batches.todo.ready))
            monkeypatch.setattr(batches_mod, "retrying", real)
            await batches.give_back_borrowed("a test, nothing borrowed meanwhile")
            return kept, first.dropped, ref in held.borrowed
        finally:
            batches.close()
            await conn.aclose()

    kept, first_dropped, still_borrowed = asyncio.run(scenario())
    assert first_dropped
    assert kept, "the prompts borrowed again are borrowed by nothing here"
    assert not still_borrowed, "a borrowed batch given back is still borrowed"
