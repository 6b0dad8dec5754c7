"""A server that now serves another model: its batches are handed back once, and nothing of a job of the old
model is taken again afterwards (worker/gate.py's ServerWatch, worker/intake.py's skip list). The engine's parts
in this process against the real test Redis; the server is a stand-in that only tells its model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis
import redis.asyncio as aioredis

from genq.core import keys
from genq.core.queueing import new_batches, save_config, write_batches
from genq.core.records import JobConfig, Prompt
from genq.worker import intake as intake_mod
from genq.worker.batches import Batches
from genq.worker.controller import Running
from genq.worker.engines import SGLANG, ServerInfo
from genq.worker.gate import ServerWatch
from genq.worker.held import Holdings
from genq.worker.intake import Intake, Shares
from genq.worker.options import WorkerOptions

OLD, NEW = "old-model", "new-model"


class _Dispatcher:
    """What the intake reads of the dispatcher: the watch, and that it takes work."""

    def __init__(self, watch: ServerWatch) -> None:
        self.watch = watch

    def accepting(self) -> bool:
        return True


def queue_job(conn: redis.Redis, job: str, output: Path) -> str:
    """One batch of two prompts for `job`, a job of OLD, queued as `genq enqueue` queues it; its id."""
    save_config(conn, JobConfig(name=job, output=str(output), model=OLD, incarnation="i-" + job))
    prompts = [Prompt(id=f"{job}-{i}", index=i, messages=[{"role": "user", "content": "x"}]) for i in range(2)]
    (made,) = new_batches(conn, job, prompts, 2)
    with conn.pipeline(transaction=True) as pipe:
        write_batches(pipe, conn, [made], {})
        pipe.execute()
    return made.id


def test_a_batch_handed_back_for_another_model_is_not_taken_again(redis_url: str, rconn: redis.Redis,
                                                                   tmp_path: Path, monkeypatch) -> None:
    """The watch hands a held batch back when the server serves another model; the intake's next look at the
    queue leaves it there, though its view of the jobs' models was read under the old model just before (its
    refresh interval made long: no clock decides this). Before, the intake took it again and its model gate
    handed it back once more: a second hand-back and a second RQ job for nothing."""
    monkeypatch.setattr(intake_mod, "FOREIGN_EVERY_S", 3600.0)
    batch = queue_job(rconn, "j", tmp_path / "out")

    async def scenario() -> tuple[bool, bytes | None, bytes | None, int]:
        conn = aioredis.Redis.from_url(redis_url)
        held = Holdings()
        batches = Batches(conn, rconn, "w", "w.1", held, Running())
        opts = WorkerOptions(redis_url=redis_url, server_url="http://127.0.0.1:1")
        watch = ServerWatch(opts, None, None, None, batches)  # type: ignore[arg-type]  # only its model is read
        watch.info = ServerInfo(SGLANG, model=OLD)
        intake = Intake(opts, batches, _Dispatcher(watch), Shares(conn, "q", "w.1", batches))  # type: ignore[arg-type]
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
