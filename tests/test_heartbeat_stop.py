"""Nothing of the heartbeat lands after the worker's `stopped` (worker/heartbeat.py): a beat under way when the
worker stops writes before it, and a beat of the loop after it writes nothing. A status written after `stopped`
keeps a TTL, and the worker reads as lost once it expires (seen as a flake of the fleet tests: a drained worker
read as "lost"); an alive key written after it says the instance lives on. The engine's parts in this process
against the real test Redis; the beat under way is held by its Redis client, handed to the parts by name."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis

from genq.core import keys
from genq.core.records import WorkerStatus, unpack
from genq.worker.batches import Batches
from genq.worker.controller import ConcurrencyController, Running
from genq.worker.dispatch import Dispatcher
from genq.worker.engine import StopNow
from genq.worker.gate import Gate, ServerWatch
from genq.worker.heartbeat import Heartbeat, IdlePace
from genq.worker.held import Holdings
from genq.worker.options import WorkerOptions
from genq.worker.server import ServerClient


class HeldRedis(aioredis.Redis):
    """A client whose next pipeline, once `hold` is set, waits for it before sending anything (a beat under
    way, nothing written yet)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hold: asyncio.Event | None = None
        self.holding = asyncio.Event()  # the held pipeline waits

    def pipeline(self, transaction: bool = True, shard_hint=None):
        pipe = super().pipeline(transaction, shard_hint)
        if self.hold is not None:
            hold, self.hold, execute = self.hold, None, pipe.execute

            async def held(raise_on_error: bool = True):
                self.holding.set()
                await hold.wait()
                return await execute(raise_on_error)

            pipe.execute = held  # type: ignore[method-assign]
        return pipe


def waits_for_a_lock(task: asyncio.Task) -> bool:
    """Whether the task is suspended taking an asyncio lock: its chain of awaits ends in Lock.acquire."""
    coro, innermost = task.get_coro(), None
    while (code := getattr(coro, "cr_code", None)) is not None:
        coro, innermost = coro.cr_await, code
    return innermost is not None and (innermost.co_name, innermost.co_filename) == ("acquire", asyncio.locks.__file__)


def test_a_beat_under_way_when_the_worker_stops_lands_before_stopped_and_none_after(
        redis_url: str, rconn: redis.Redis) -> None:
    opts = WorkerOptions(redis_url=redis_url, server_url="http://127.0.0.1:1")

    async def scenario() -> None:
        conn = HeldRedis.from_url(redis_url)
        controller, held = ConcurrencyController(None, None), Holdings()
        batches = Batches(conn, rconn, "w", "w.1", held, Running())
        stopping = StopNow(conn, "w", held, batches.writer)
        watch = ServerWatch(opts, ServerClient(opts.server_url), controller, stopping, batches)
        dispatcher = Dispatcher(opts, watch.client, batches, watch, Gate(batches, controller, watch))
        heartbeat = Heartbeat(opts, "host", batches, dispatcher, IdlePace(held, dispatcher))
        try:
            await heartbeat.beat()  # the first: the worker alive, its status written
            release = conn.hold = asyncio.Event()
            beat = asyncio.create_task(heartbeat.beat())  # the loop's beat, held before it writes
            await conn.holding.wait()
            stopping.requested = 1
            stop = asyncio.create_task(heartbeat.stopped())
            while not stop.done() and not waits_for_a_lock(stop):  # its Redis commands answered meanwhile
                await asyncio.sleep(0.01)
            release.set()
            await asyncio.gather(beat, stop)
            await heartbeat.beat()  # a beat of the loop after the stop
        finally:
            batches.close()
            await watch.client.close()
            await conn.aclose()

    asyncio.run(scenario())
    raw = rconn.get(keys.worker_status("w"))
    state = unpack(raw, WorkerStatus).state if raw else None
    assert state == "stopped", f"the status written last says {state}: written after the stop"
    assert rconn.ttl(keys.worker_status("w")) == -1, "the stopped status has a TTL: the worker would read as lost"
    assert not rconn.exists(keys.engine_alive("w.1")), "the stopped instance is alive"
