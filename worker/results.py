"""Group commit of results and dead letters to Redis.

Each result is written with HSETNX and counted in the same Lua call, so the
counters the monitor reads always equal the results stored, even when a batch
is re-run after a crash or two workers race on the same batch. A result is stored
without its copy of the prompt (records.without_prompt): the batch holds the prompt,
and the shard joins them again (worker/completion.py). Outcomes are written only for the
job's incarnation they were generated for (genq.core.ledger): a deleted job's late
results are dropped, never attached to the prompts of a new job of the same name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from genq.core import keys
from genq.core.histogram import length_bucket
from genq.core.ledger import INCARNATION_LUA
from genq.core.records import DeadLetter, Result, pack, without_prompt
from genq.core.words import plural

log = logging.getLogger("genq.worker")

# KEYS: results, done-set, worker-stats, hist, dlq, job-workers, claims, config
# ARGV: batch, worker, now, n, (id, blob, in_tok, out_tok, bucket)*n, m, (id, blob)*m, first sent, incarnation
# (first sent: when the earliest request of these outcomes was sent; a worker's first_at for the job)
# -> {added, dead}; {-1, -1}: the batch is done; {-2, -2}: not the job's incarnation (nothing written).
# One final state per prompt, first writer wins: a result is kept only if the prompt
# has no result and no dead letter yet, a dead letter only if it has neither; the
# counters move only for what was kept, so they always equal what is stored.
RECORD_SCRIPT = INCARNATION_LUA + """
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return {-1, -1} end
if not incarnation_ok(KEYS[8], ARGV[#ARGV]) then return {-2, -2} end
local i = 5
local added, dead, intok, outtok = 0, 0, 0, 0
for _ = 1, tonumber(ARGV[4]) do
  if redis.call('HEXISTS', KEYS[5], ARGV[i]) == 0 and redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then
    added = added + 1
    intok = intok + tonumber(ARGV[i + 2])
    outtok = outtok + tonumber(ARGV[i + 3])
    redis.call('HINCRBY', KEYS[4], ARGV[i + 4], 1)
  end
  i = i + 5
end
local m = tonumber(ARGV[i])
i = i + 1
for _ = 1, m do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 and redis.call('HSETNX', KEYS[5], ARGV[i], ARGV[i + 1]) == 1 then
    dead = dead + 1
  end
  i = i + 2
end
-- Every prompt written here has its outcome now: its claim (worker/claims.py) is over.
i = 5
for _ = 1, tonumber(ARGV[4]) do redis.call('HDEL', KEYS[7], ARGV[i]); i = i + 5 end
i = i + 1
for _ = 1, m do redis.call('HDEL', KEYS[7], ARGV[i]); i = i + 2 end
if added > 0 or dead > 0 then
  redis.call('HINCRBY', KEYS[3], 'done', added)
  redis.call('HINCRBY', KEYS[3], 'failed', dead)
  redis.call('HINCRBY', KEYS[3], 'in_tok', intok)
  redis.call('HINCRBY', KEYS[3], 'out_tok', outtok)
  redis.call('HSETNX', KEYS[3], 'first_at', ARGV[#ARGV - 1])
  redis.call('HSET', KEYS[3], 'last_at', ARGV[3])
  redis.call('SADD', KEYS[6], ARGV[2])
end
return {added, dead}
"""


def record_call(job: str, batch: str, worker: str, now: str, results: list[Result],
                dead: list[DeadLetter], incarnation: str) -> tuple[list[str], list]:
    """RECORD_SCRIPT's keys and arguments for one batch's outcomes (bench/footprint.py drives it too)."""
    args: list = [batch, worker, now, len(results)]
    for r in results:
        args += [r.id, pack(without_prompt(r)), r.usage.prompt_tokens, r.usage.completion_tokens,
                 length_bucket(r.usage.completion_tokens)]
    args.append(len(dead))
    for d in dead:
        args += [d.id, pack(d)]
    # The job's elapsed time and rate run from the first request, not from the first answer.
    sent = min([r.finished_at - r.latency_s for r in results if r.finished_at] + [float(now)])
    args += [repr(sent), incarnation]
    script_keys = [keys.batch_results(job, batch), keys.job_done(job), keys.worker_stats(job, worker),
                   keys.job_hist(job), keys.job_dlq(job), keys.job_workers(job), keys.batch_claims(job, batch),
                   keys.job_config(job)]
    return script_keys, args


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
        self._script = conn.register_script(RECORD_SCRIPT)
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
            self._wake.clear()
            taking, self._buffer = self._buffer, {}
            try:
                await self._write(list(taking.values()))
            except (redis.RedisError, OSError) as exc:
                # Keep everything in memory and try again: results are never dropped.
                self.last_error = f"{type(exc).__name__}: {exc}"
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
        async with self.conn.pipeline(transaction=False) as pipe:
            for group in groups:
                script_keys, args = record_call(group.job, group.batch, self.worker, now, group.results, group.dead,
                                                group.incarnation)
                await self._script(keys=script_keys, args=args, client=pipe)
            answers = await pipe.execute()
        for group, (added, _) in zip(groups, answers):
            if added == -2:
                log.info("batch %s/%s: %s not recorded: the job was deleted (or enqueued again) meanwhile",
                         group.job, group.batch, plural(len(group.results) + len(group.dead), "outcome"))
                continue
            self.on_written(group.job, group.batch,
                            [r.id for r in group.results] + [d.id for d in group.dead])

