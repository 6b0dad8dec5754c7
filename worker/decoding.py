"""The requests in flight, and how fast one decodes against how many decode at once (the monitor's
ETA needs that curve: a job's last requests speed up as it drains; no engine reports it).

While `d` sequences decode (first token to end), request-seconds and streamed tokens go to d's bin,
apart for while some request waits for its first token ("clean": none does). Figures halve every
HALF_LIFE_S; published as WorkerStatus.decode (monitor/rates.py fits them), stored per server and model.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from genq.core.ledger import fleet
from genq.core.records import DecodeBin, ServerDecode

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from redis.asyncio.client import Pipeline

    from genq.worker.held import Task
    from genq.worker.server import Progress

HALF_LIFE_S = 3600.0  # the figures of an hour ago weigh half of this minute's
STORED_TTL_S = 7 * 86400  # a server's stored figures are dropped after a week unused
BINS_PER_OCTAVE = 4  # published bins: exact counts up to 4, then four a doubling
MIN_BUSY_S = 0.05  # a bin with less than this many request-seconds is not published


class Running(dict["Task", "asyncio.Task[None]"]):
    """The requests in flight and the sequences they are on the server (each of n choices is one)."""

    def __init__(self) -> None:
        super().__init__()
        self.sequences = 0
        self.meter = DecodeMeter()

    def __setitem__(self, task: Task, aio: asyncio.Task[None]) -> None:
        if task not in self:
            self.sequences += task.progress.sequences
            self.meter.sent(task.progress)
        super().__setitem__(task, aio)

    def pop(self, task: Task, default: Any = None) -> Any:
        if task in self:
            self.sequences -= task.progress.sequences
            self.meter.ended(task.progress)
        return super().pop(task, default)

    def cancel_all(self, reason: str) -> None:
        """Stop every request; each ends as a failure with `reason`."""
        for task, aio in list(self.items()):
            task.cancel_reason = reason
            aio.cancel()


class DecodeMeter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.decoding = 0  # sequences between their first token and their end
        self.waiting = 0  # sequences sent that have no token yet
        self._since = self._decayed_at = clock()
        self.bins: dict[tuple[int, bool], list[float]] = {}  # (decoding, clean) -> [request-seconds, tokens]
        self.news = False  # tokens booked since the figures were last stored

    def _account(self, now: float) -> list[float] | None:
        """Books the time since the last change to the current count; its bin (None at 0)."""
        d, since, self._since = self.decoding, self._since, now
        if d <= 0:
            return None
        b = self.bins.setdefault((d, self.waiting <= 0), [0.0, 0.0])
        b[0] += d * (now - since)
        return b

    def sent(self, progress: Progress) -> None:
        """Until its first token it waits at the server."""
        if not progress.decoding and not progress.waiting:
            self._account(self.clock())
            progress.waiting = True
            self.waiting += progress.sequences

    def _arrived(self, progress: Progress) -> None:
        if progress.waiting:
            progress.waiting = False
            self.waiting -= progress.sequences

    def advance(self, progress: Progress, tokens: int) -> None:
        """A streamed request has made `tokens` in all (a first chunk's tokens are the prefill's)."""
        if tokens <= progress.tokens:
            progress.tokens = tokens
            return
        b = self._account(self.clock())
        if progress.decoding:
            if b is not None:
                b[1] += tokens - progress.tokens
                self.news = True
        else:  # its first token: it decodes from now on
            progress.decoding = True
            self.decoding += progress.sequences
            self._arrived(progress)
        progress.tokens = tokens

    def ended(self, progress: Progress) -> None:
        """The request is no longer in flight."""
        if progress.decoding or progress.waiting:
            self._account(self.clock())
            self._arrived(progress)
        if progress.decoding:
            progress.decoding = False
            self.decoding -= progress.sequences

    def figures(self) -> list[DecodeBin]:
        """The bins merged to BINS_PER_OCTAVE a doubling, after the decay: what the worker publishes."""
        now = self.clock()
        self._account(now)
        factor = 0.5 ** ((now - self._decayed_at) / HALF_LIFE_S)
        self._decayed_at = now
        merged: dict[tuple[int, bool], list[float]] = {}
        for (d, clean), b in self.bins.items():
            b[0] *= factor
            b[1] *= factor
            key = (d if d <= BINS_PER_OCTAVE else round(BINS_PER_OCTAVE * math.log2(d)) + BINS_PER_OCTAVE * 8, clean)
            m = merged.setdefault(key, [0.0, 0.0, 0.0])
            m[0] += b[0]
            m[1] += b[1]
            m[2] += d * b[0]
        return [DecodeBin(decoding=round(m[2] / m[0], 2), busy_s=round(m[0], 3), tokens=round(m[1], 1), clean=clean)
                for (_, clean), m in sorted(merged.items()) if m[0] >= MIN_BUSY_S]

    def seed(self, stored: ServerDecode, now: float) -> None:
        """Begin from what earlier workers measured on this server, decayed by its age."""
        factor = 0.5 ** (max(0.0, now - stored.at) / HALF_LIFE_S)
        for b in stored.bins:
            d = max(1, round(b.decoding))
            mine = self.bins.setdefault((d, b.clean), [0.0, 0.0])
            mine[0] += b.busy_s * factor
            mine[1] += b.tokens * factor


async def load(conn: aioredis.Redis, meter: DecodeMeter, server: str, model: str) -> None:
    if (stored := await fleet.server_decode(conn, server, model)) is not None:
        meter.seed(stored, time.time())


def store(pipe: Pipeline, meter: DecodeMeter, bins: list[DecodeBin], server: str, model: str, worker: str) -> None:
    """Stores the figures in a beat's pipeline when tokens were booked since the last time."""
    if meter.news and bins:
        fleet.stage_server_decode(pipe, server, model, ServerDecode(at=time.time(), worker=worker, bins=bins),
                                  STORED_TTL_S)
        meter.news = False
