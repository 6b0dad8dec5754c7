"""Told to stop now, a worker stops within seconds whatever its Redis does: the shutdown goes on only
while Redis answers a PING; else what it holds is not recorded, its leases lapse, and the reconcilers
queue its batches again once Redis is back (docs/exactly-once.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any

import redis
import redis.asyncio as aioredis

from genq.core.words import plural
from genq.worker.held import Holdings
from genq.worker.results import ResultWriter

log = logging.getLogger("genq.worker")

# The shutdown goes on while Redis answers a PING within PING_S, asked every STOP_NOW_S, for up to
# STOP_NOW_MAX_S (a Redis that answers pings but never takes the hand-back).
STOP_NOW_S = 5.0
STOP_NOW_MAX_S = 30.0
PING_S = 1.0
EXIT_BY_S = 10.0  # then the process ends itself: a thread blocked on a frozen Redis would hold its exit
LOOK_S = 0.5  # how often the shutdown is looked at


class StopNow:
    def __init__(self, conn: aioredis.Redis, worker: str, held: Holdings, writer: ResultWriter) -> None:
        self.conn, self.worker, self.held, self.writer = conn, worker, held, writer
        self.requested = 0  # 1: finish what is held, then exit; 2: stop now (a second signal, the grace over)
        self.since: float | None = None  # monotonic: when the worker was told to stop now
        self.without_redis = False  # the shutdown was given up: Redis did not answer, or took too long

    def finish(self) -> None:
        self.requested = max(self.requested, 1)

    def start(self) -> None:
        self.requested = 2
        if self.since is None:
            self.since = time.monotonic()

    async def run(self, finish: Coroutine[Any, Any, None]) -> None:
        """Run the shutdown `finish`; told to stop now, only while Redis answers (see STOP_NOW_S)."""
        finishing = asyncio.create_task(finish)
        ask_at = 0.0  # monotonic: when to ask Redis again
        try:
            while True:
                await asyncio.wait({finishing}, timeout=LOOK_S)
                if finishing.done():
                    finishing.result()  # its error, if it failed
                    return
                now = time.monotonic()
                if self.since is None or now < max(ask_at, self.since + STOP_NOW_S):
                    continue
                if now - self.since >= STOP_NOW_MAX_S or not await self._redis_answers():
                    break
                ask_at = now + STOP_NOW_S
        finally:
            finishing.cancel()  # nothing once it is done; it goes with the caller if that is cancelled
        with contextlib.suppress(asyncio.CancelledError, redis.RedisError, OSError):
            await finishing
        await self._without_redis()

    async def _redis_answers(self) -> bool:
        try:
            async with asyncio.timeout(PING_S):
                return bool(await self.conn.ping())
        except (TimeoutError, redis.RedisError, OSError):
            return False

    async def _without_redis(self) -> None:
        self.without_redis = True
        log.warning("stopping now, Redis away: %s not handed back, %s not recorded; their leases lapse and "
                    "other workers take them once Redis is back", plural(len(self.held), "batch", "batches"),
                    plural(self.writer.pending, "result"))
        backstop = threading.Timer(EXIT_BY_S, self._exit_now)
        backstop.daemon = True
        backstop.start()

    def _exit_now(self) -> None:
        log.warning("worker %s: not exited %.0fs after stopping without Redis (a thread waits on it): exiting now",
                    self.worker, EXIT_BY_S)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(0)
