"""Group commit of results and dead letters: each written and counted in one Lua call (RECORD), first
writer wins, only for the job incarnation it was generated for, so the counters equal what is stored.
Its own module: `make mutation` mutates it (docs/mutation.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from genq.core import scripts
from genq.core.records import DeadLetter, Result
from genq.core.redisconn import in_words
from genq.core.words import plural

log = logging.getLogger("genq.worker")

RECORD_LINGER_S = 0.005  # the first outcome of a group waits this long for others: one RECORD for many


@dataclass
class _Pending:
    results: list[Result] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)


class ResultWriter:
    """Outcomes buffered, a RECORD call per batch once the previous write is done; then `batches.on_written`."""

    def __init__(self, conn: aioredis.Redis, worker: str, batches: Any) -> None:
        self.conn, self.worker, self.batches = conn, worker, batches
        self._buffer: defaultdict[tuple[str, str, str], _Pending] = defaultdict(_Pending)  # (job, batch, incarnation)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._script = conn.register_script(scripts.RECORD)
        self.last_error: str | None = None

    def add_result(self, result: Result, incarnation: str) -> None:
        self._slot(result.job, result.batch, incarnation).results.append(result)

    def add_dead(self, letter: DeadLetter, incarnation: str) -> None:
        self._slot(letter.job, letter.batch, incarnation).dead.append(letter)

    def _slot(self, job: str, batch: str, incarnation: str) -> _Pending:
        self._idle.clear()
        self._wake.set()
        return self._buffer[(job, batch, incarnation)]

    @property
    def pending(self) -> int:
        return sum(len(p.results) + len(p.dead) for p in self._buffer.values())

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def run(self) -> None:
        backoff = 0.2
        while True:
            await self._wake.wait()
            await asyncio.sleep(RECORD_LINGER_S)
            self._wake.clear()
            taking, self._buffer = self._buffer, defaultdict(_Pending)
            try:
                await self._write(taking)
            except (redis.RedisError, OSError) as exc:
                # Keep everything in memory and try again: results are never dropped.
                self.last_error = in_words(exc)
                log.warning("cannot write results to Redis (%s); %d kept in memory, retrying in %.1fs",
                            self.last_error, sum(len(p.results) + len(p.dead) for p in taking.values()), backoff)
                for key, pending in taking.items():
                    self._buffer[key].results[:0] = pending.results
                    self._buffer[key].dead[:0] = pending.dead
                self._wake.set()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            backoff = 0.2
            self.last_error = None
            if not self._buffer:
                self._idle.set()

    async def _write(self, groups: dict[tuple[str, str, str], _Pending]) -> None:
        now = repr(time.time())
        calls = [scripts.record_call(job, batch, self.worker, now, g.results, g.dead, incarnation)
                 for (job, batch, incarnation), g in groups.items()]
        for ((job, batch, _), g), (added, _) in zip(groups.items(), await self._pipelined(calls)):
            if added == -2:
                log.info("batch %s/%s: %s not recorded: the job was deleted (or enqueued again) meanwhile",
                         job, batch, plural(len(g.results) + len(g.dead), "outcome"))
                continue
            self.batches.on_written(job, batch, [r.id for r in g.results] + [d.id for d in g.dead], g.results)

    async def _pipelined(self, calls: list[tuple[list[str], list]]) -> list:
        """The calls in one round trip, by EVALSHA (redis-py's pipelined scripts add a SCRIPT EXISTS); once more
        after loading the script if Redis lost it (a restart): RECORD is safe to run twice (first writer wins)."""
        for _ in range(2):
            async with self.conn.pipeline(transaction=False) as pipe:
                for script_keys, args in calls:
                    pipe.evalsha(self._script.sha, len(script_keys), *script_keys, *args)
                answers = await pipe.execute(raise_on_error=False)
            if not any(isinstance(a, NoScriptError) for a in answers):
                for answer in answers:
                    if isinstance(answer, Exception):
                        raise answer
                return answers
            await self.conn.script_load(scripts.RECORD)
        raise NoScriptError("RECORD could not be loaded")
