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
from redis.exceptions import NoScriptError

from genq.core import keys
from genq.core.histogram import length_bucket
from genq.core.ledger import INCARNATION_LUA
from genq.core.luapack import lua_list
from genq.core.records import DeadLetter, Result, pack, without_prompt
from genq.core.words import plural

log = logging.getLogger("genq.worker")

# Outcomes are written in groups: the first one of a group waits this long for others, so one
# RECORD call covers many prompts (issue #29: Redis commands per prompt). Nothing waits for a
# record but the batch's end: a few ms there cost nothing.
RECORD_LINGER_S = 0.005

# KEYS: results, done-set, worker-stats, hist, dlq, job-workers, claims, config
# ARGV: batch, worker, now, incarnation, results (msgpack: id, blob, in_tok, out_tok, bucket, ...),
#       dead letters (msgpack: id, blob, ...), first sent
# (first sent: when the earliest request of these outcomes was sent; a worker's first_at for the job)
# -> {added, dead}; {-1, -1}: the batch is done; {-2, -2}: not the job's incarnation (nothing written).
# One final state per prompt, first writer wins: a result is kept only if the prompt
# has no result and no dead letter yet, a dead letter only if it has neither; the
# counters move only for what was kept, so they always equal what is stored.
# A group of prompts costs a fixed dozen commands or so, not a few per prompt (issue #29):
# the outcomes already stored are read with one HMGET per hash, the new ones written with
# one HSET, their claims ended with one HDEL, the histogram with one HINCRBY per length bucket.
RECORD_SCRIPT = INCARNATION_LUA + """
local CHUNK = 1000  -- fields per HMGET/HSET/HDEL (Lua's unpack has a stack limit)
local function each_chunk(list, step, fn)
  for first = 1, #list, CHUNK * step do
    fn(unpack(list, first, math.min(#list, first + CHUNK * step - 1)))
  end
end
local function hmget(key, ids)
  local out = {}
  each_chunk(ids, 1, function(...)
    local got = redis.call('HMGET', key, ...)  -- false where the field is missing
    for j = 1, #got do out[#out + 1] = got[j] end
  end)
  return out
end

if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return {-1, -1} end
if not incarnation_ok(KEYS[8], ARGV[4]) then return {-2, -2} end
local rs, ds = cmsgpack.unpack(ARGV[5]), cmsgpack.unpack(ARGV[6])
local ids = {}
for i = 1, #rs, 5 do ids[#ids + 1] = rs[i] end
for i = 1, #ds, 2 do ids[#ids + 1] = ds[i] end
if #ids == 0 then return {0, 0} end
-- Prompts with an outcome already (a result or a letter): nothing more is stored for them.
local has_result, has_letter = hmget(KEYS[1], ids), hmget(KEYS[5], ids)
local over = {}
for k = 1, #ids do
  if has_result[k] then over[ids[k]] = 'result' end
  if has_letter[k] then over[ids[k]] = 'letter' end
end
local added, dead, intok, outtok = 0, 0, 0, 0
local results, letters, buckets, bucket_order = {}, {}, {}, {}
for i = 1, #rs, 5 do
  if not over[rs[i]] then
    over[rs[i]] = 'result'
    results[#results + 1] = rs[i]
    results[#results + 1] = rs[i + 1]
    added = added + 1
    intok = intok + tonumber(rs[i + 2])
    outtok = outtok + tonumber(rs[i + 3])
    local bucket = tostring(rs[i + 4])
    if not buckets[bucket] then bucket_order[#bucket_order + 1] = bucket end
    buckets[bucket] = (buckets[bucket] or 0) + 1
  end
end
for i = 1, #ds, 2 do
  if not over[ds[i]] then
    over[ds[i]] = 'letter'
    letters[#letters + 1] = ds[i]
    letters[#letters + 1] = ds[i + 1]
    dead = dead + 1
  end
end
each_chunk(results, 2, function(...) redis.call('HSET', KEYS[1], ...) end)
each_chunk(letters, 2, function(...) redis.call('HSET', KEYS[5], ...) end)
-- Every prompt written here has its outcome now: its claim (worker/claims.py) is over.
each_chunk(ids, 1, function(...) redis.call('HDEL', KEYS[7], ...) end)
for _, bucket in ipairs(bucket_order) do redis.call('HINCRBY', KEYS[4], bucket, buckets[bucket]) end
if added > 0 or dead > 0 then
  redis.call('HINCRBY', KEYS[3], 'done', added)
  redis.call('HINCRBY', KEYS[3], 'failed', dead)
  redis.call('HINCRBY', KEYS[3], 'in_tok', intok)
  redis.call('HINCRBY', KEYS[3], 'out_tok', outtok)
  redis.call('HSETNX', KEYS[3], 'first_at', ARGV[7])
  redis.call('HSET', KEYS[3], 'last_at', ARGV[3])
  redis.call('SADD', KEYS[6], ARGV[2])
end
return {added, dead}
"""


def record_call(job: str, batch: str, worker: str, now: str, results: list[Result],
                dead: list[DeadLetter], incarnation: str) -> tuple[list[str], list]:
    """RECORD_SCRIPT's keys and arguments for one batch's outcomes (bench/footprint.py drives it too)."""
    flat: list = []
    for r in results:
        flat += [r.id, pack(without_prompt(r)), r.usage.prompt_tokens, r.usage.completion_tokens,
                 length_bucket(r.usage.completion_tokens)]
    letters: list = []
    for d in dead:
        letters += [d.id, pack(d)]
    # The job's elapsed time and rate run from the first request, not from the first answer.
    sent = min([r.finished_at - r.latency_s for r in results if r.finished_at] + [float(now)])
    args: list = [batch, worker, now, incarnation, lua_list(flat), lua_list(letters), repr(sent)]
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
            await asyncio.sleep(RECORD_LINGER_S)
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
            await self.conn.script_load(RECORD_SCRIPT)
        raise NoScriptError("RECORD could not be loaded")

