"""Waiting in a task that must stay stoppable: for an asyncio event, and for Redis to answer again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis

log = logging.getLogger("genq.worker")
T = TypeVar("T")


async def retrying(action: Callable[[], Awaitable[T]], what: str = "redis") -> T:
    """Redis errors (a restart, a dropped connection) are waited out, never lost."""
    backoff = 0.5
    while True:
        try:
            return await action()
        except (redis.RedisError, OSError) as exc:
            log.warning("%s: %s; retrying in %.1fs", what, exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10)


async def wait_event(event: asyncio.Event, seconds: float | None) -> bool:
    """Whether `event` was set within `seconds`. Not asyncio.wait_for: on Python 3.11 it swallows a cancel
    that lands in the turn the event is set; asyncio.timeout tells its own cancel from anyone else's."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True
