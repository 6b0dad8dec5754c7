"""Group commit of results and dead letters to Redis.

Each outcome is written and counted in one Lua call (RECORD), first writer wins, only for the
job's incarnation it was generated for; so the monitor's counters equal the results stored.
A result is stored without its prompt: the shard joins them again (worker/completion.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from genq.core.records import DeadLetter, Result
from genq.core.redisconn import in_words
from genq.core.scripts import RECORD, record_call
from genq.core.words import plural

log = logging.getLogger("genq.worker")

# The first outcome of a group waits this long for others: one RECORD call covers many prompts.
RECORD_LINGER_S = 0.005


@dataclass
class _Pending:
    job: str
    batch: str
    incarnation: str  # the job's incarnation the outcomes were generated for
    results: list[Result]
    dead: list[DeadLetter]


class ResultWriter:
    """Buffers records and writes them as soon as the previous write is done."""

    def __init__(self, conn: aioredis.Redis, worker: str, on_written) -> None:
        self.conn = conn
        self.worker = worker
        self.on_written = on_written  # callback(job, batch, [ids]) after a durable write
        self._buffer: dict[tuple[str, str, str], _Pending] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._script = conn.register_script(RECORD)
        self.last_error: str | None = None

    def add_result(self, result: Result, incarnation: str) -> None:
        self._slot(result.job, result.batch, incarnation).results.append(result)

    def add_dead(self, letter: DeadLetter, incarnation: str) -> None:
        self._slot(letter.job, letter.batch, incarnation).dead.append(letter)

    def _slot(self, job: str, batch: str, incarnation: str) -> _Pending:
        self._idle.clear()
        self._wake.set()
        slot = self._buffer.get((job, batch, incarnation))
        if slot is None:
            slot = self._buffer[(job, batch, incarnation)] = _Pending(job, batch, incarnation, [], [])
        return slot

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
            taking, self._buffer = self._buffer, {}
            try:
                await self._write(list(taking.values()))
            except (redis.RedisError, OSError) as exc:
                # Keep everything in memory and try again: results are never dropped.
                self.last_error = in_words(exc)
                log.warning("cannot write results to Redis (%s); %d kept in memory, retrying in %.1fs",
                            self.last_error, sum(len(p.results) + len(p.dead) for p in taking.values()), backoff)
                for key, pending in taking.items():
                    slot = self._buffer.setdefault(key, _Pending(pending.job, pending.batch, pending.incarnation, [], []))
                    slot.results[:0] = pending.results
                    slot.dead[:0] = pending.dead
                self._wake.set()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            backoff = 0.2
            self.last_error = None
            if not self._buffer:
                self._idle.set()

    async def _write(self, groups: list[_Pending]) -> None:
        now = repr(time.time())
        calls = [record_call(g.job, g.batch, self.worker, now, g.results, g.dead, g.incarnation) for g in groups]
        if len(calls) == 1:  # the common case: one call, no pipeline (redis-py's adds a SCRIPT EXISTS to each)
            answers = [await self._script(keys=calls[0][0], args=calls[0][1])]
        else:
            answers = await self._pipelined(calls)
        for group, (added, _) in zip(groups, answers):
            if added == -2:
                log.info("batch %s/%s: %s not recorded: the job was deleted (or enqueued again) meanwhile",
                         group.job, group.batch, plural(len(group.results) + len(group.dead), "outcome"))
                continue
            self.on_written(group.job, group.batch,
                            [r.id for r in group.results] + [d.id for d in group.dead])

    async def _pipelined(self, calls: list[tuple[list[str], list]]) -> list:
        """Several batches' calls in one round trip, by EVALSHA; once more after loading the script
        if Redis lost it (a restart): RECORD is safe to run twice (first writer wins)."""
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
            await self.conn.script_load(RECORD)
        raise NoScriptError("RECORD could not be loaded")

