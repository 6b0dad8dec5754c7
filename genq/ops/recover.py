"""A job's ledger rebuilt from its output (#31): what is written is done, whatever Redis says.

Three ways a ledger falls behind its output, one answer (ADOPT, per written batch):
- Redis lost the job (restarted empty, FLUSHALL): `genq recover` or the same `genq enqueue`
  finds OUTPUT/JOB/job.json, takes the job's config and incarnation from it, drops what
  Redis holds of the job (orphans written by workers into the empty Redis) and adopts every
  marker of that incarnation; then only prompts with no written outcome are queued again.
- Redis lost its recent writes (a snapshot restored, a failover to a lagging replica): a
  batch written since looks unfinished. A worker about to drive it, a worker whose shard
  write finds the marker there, and every worker's maintenance (after a Redis restart, and
  once a minute) adopt it from its marker instead of generating it again.
- A second writer with other bytes: the first marker stands (genq.output.truth).

ADOPT marks the batch done with the marker's ShardInfo exactly as RELEASE would, and sets
the counters to what the shard holds: what Redis had counted for the batch's stored results
is taken back, the marker's tally counted instead, so the monitor's figures equal the output.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import redis

from genq.core import keys, ledger
from genq.core.queueing import batch_number, list_jobs, load_config, stage_config
from genq.core.records import JobConfig, JobRecord, ShardMarker, pack
from genq.core.words import plural
from genq.output import truth
from genq.output.sink import open_store

log = logging.getLogger("genq.recover")

# KEYS: done, shards, results, batch record, leases, transport, stats, claims, hist, dlq, job workers,
#       batches, ids, config, tries
# ARGV: batch, ShardInfo blob, reply TTL, keys.lease_reply(TOKEN_SLOT), records, bytes, worker-stats key
#       prefix, tally {worker: [results, in_tok, out_tok]}, hist {bucket: n}, letters [[id, blob hex, worker]],
#       digests {id: hex}, the batch's number, a token to tell "done" besides the current lease's ("" none)
# -> 0 already done, 1 adopted, 'gone' (the job is not in Redis as the life that wrote the shard)
ADOPT = ledger._COUNT_SHARDS + ledger.INCARNATION_LUA + """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 0 end
if not incarnation_ok(KEYS[14], ARGV[14]) then return 'gone' end
local function wstats(worker) return ARGV[7] .. worker end
-- What Redis counted for the results it stores of this batch is taken back ...
local stored = redis.call('HGETALL', KEYS[3])
for i = 2, #stored, 2 do
  local r = cmsgpack.unpack(stored[i])
  local usage = r['usage'] or {}
  local pt, ct = usage['prompt_tokens'] or 0, usage['completion_tokens'] or 0
  redis.call('HINCRBY', wstats(r['worker']), 'done', -1)
  redis.call('HINCRBY', wstats(r['worker']), 'in_tok', -pt)
  redis.call('HINCRBY', wstats(r['worker']), 'out_tok', -ct)
  redis.call('HINCRBY', KEYS[9], math.floor(4 * math.log(ct + 1) / math.log(2) + 0.5), -1)
end
-- ... and what the shard holds is counted instead.
for worker, t in pairs(cmsgpack.unpack(ARGV[8])) do
  redis.call('HINCRBY', wstats(worker), 'done', t[1])
  redis.call('HINCRBY', wstats(worker), 'in_tok', t[2])
  redis.call('HINCRBY', wstats(worker), 'out_tok', t[3])
  redis.call('SADD', KEYS[11], worker)
end
for bucket, n in pairs(cmsgpack.unpack(ARGV[9])) do redis.call('HINCRBY', KEYS[9], bucket, n) end
local function unhex(hex) return (hex:gsub('..', function(c) return string.char(tonumber(c, 16)) end)) end
local dead = {}
for _, l in ipairs(cmsgpack.unpack(ARGV[10])) do
  dead[l[1]] = true
  if redis.call('HSETNX', KEYS[10], l[1], unhex(l[2])) == 1 then
    redis.call('HINCRBY', wstats(l[3]), 'failed', 1)
    redis.call('SADD', KEYS[11], l[3])
  end
end
for id, hex in pairs(cmsgpack.unpack(ARGV[11])) do
  if not dead[id] then redis.call('HDEL', KEYS[10], id) end  -- the shard has its result
  redis.call('HSETNX', KEYS[13], id, unhex(hex))
end
if redis.call('EXISTS', KEYS[4]) == 0 and not redis.call('ZSCORE', KEYS[12], ARGV[1]) then
  -- A batch this Redis never saw (it was lost with the rest): part of the job again.
  redis.call('ZADD', KEYS[12], tonumber(ARGV[12]), ARGV[1])
  redis.call('HINCRBY', KEYS[7], 'total', tonumber(ARGV[5]) + #cmsgpack.unpack(ARGV[10]))
  redis.call('HINCRBY', KEYS[7], 'batches', 1)
end
redis.call('SADD', KEYS[1], ARGV[1])
count_shards(KEYS[2], KEYS[7])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[7], '@RECORDS@', tonumber(ARGV[5]))
redis.call('HINCRBY', KEYS[7], '@BYTES@', tonumber(ARGV[6]))
redis.call('DEL', KEYS[3], KEYS[4], KEYS[8], KEYS[15])
local tokens = {}
if ARGV[13] ~= '' then tokens[1] = ARGV[13] end
local lease = redis.call('HGET', KEYS[5], ARGV[1])
if lease then
  local current = string.match(lease, '^(%S+)')
  if current ~= ARGV[13] then tokens[#tokens + 1] = current end
end
for _, token in ipairs(tokens) do
  local reply = string.gsub(ARGV[4], '{token}', token)
  redis.call('RPUSH', reply, 'done')
  redis.call('EXPIRE', reply, tonumber(ARGV[3]))
end
redis.call('HDEL', KEYS[5], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
return 1
""".replace("@RECORDS@", ledger.SHARD_RECORDS).replace("@BYTES@", ledger.SHARD_BYTES)


def adopt_call(job: str, marker: ShardMarker, token: str = "") -> tuple[list[str], list[Any]]:
    """ADOPT's keys and arguments for one written batch."""
    b = marker.batch
    script_keys = [keys.job_done(job), keys.job_shards(job), keys.batch_results(job, b), keys.batch(job, b),
                   keys.job_leases(job), keys.job_transport(job), keys.job_stats(job), keys.batch_claims(job, b),
                   keys.job_hist(job), keys.job_dlq(job), keys.job_workers(job), keys.job_batches(job),
                   keys.job_ids(job), keys.job_config(job), keys.batch_tries(job, b)]
    # Hex, as the digests: Redis's cmsgpack cannot read msgpack bin (a letter's packed bytes).
    letters = [[d.id, pack(d).hex(), d.worker] for d in marker.dead_letters]
    args = [b, pack(truth.shard_info(marker)), ledger.REPLY_TTL_S, keys.lease_reply(ledger.TOKEN_SLOT),
            marker.records, marker.bytes, keys.worker_stats(job, ""), pack(marker.tally), pack(marker.hist),
            pack(letters), pack(marker.digests), batch_number(b), token, marker.incarnation]
    return script_keys, args


def adopt(conn: redis.Redis, job: str, marker: ShardMarker, token: str = "") -> bool:
    """Mark a written batch done from its marker: False if it was done already, or the job in
    Redis is not the life that wrote it."""
    script_keys, args = adopt_call(job, marker, token)
    return conn.eval(ADOPT, len(script_keys), *script_keys, *args) == 1


def catch_up(conn: redis.Redis, config: JobConfig) -> list[str]:
    """Adopt every batch of this life of the job that the output has and the ledger does not
    count as done; the batches adopted."""
    store = open_store(config.output, config.s3_endpoint_url)
    written = truth.marker_batches(store, config.name)
    done = {b.decode() for b in conn.smembers(keys.job_done(config.name))}
    markers = truth.of_life(truth.read_markers(store, config.name, written - done), config)
    adopted = [m.batch for m in markers if adopt(conn, config.name, m)]
    if adopted:
        log.warning("job %s: %s written to %s and not done in Redis (it lost recent writes); "
                    "marked done from their markers, not generated again: %s", config.name,
                    plural(len(adopted), "batch", "batches"),
                    config.output, ", ".join(adopted[:8]) + (" ..." if len(adopted) > 8 else ""))
    return adopted


@dataclass
class Recovery:
    """What rebuilding a job's ledger from its output did."""

    config: JobConfig
    record: JobRecord
    adopted: list[str]  # batches marked done from their markers
    rebuilt: bool  # the job was gone from Redis and was created again from job.json
    dropped_keys: int = 0  # keys of the job found in Redis without its config (orphans), removed


def recover(conn: redis.Redis, job: str, output: str | None = None, endpoint_url: str | None = None) -> Recovery:
    """The job's ledger brought up to its output: created again from OUTPUT/JOB/job.json when
    Redis has no config for it (output: where to look then), else caught up. Raises
    LookupError when neither Redis nor the output knows the job."""
    config = load_config(conn, job)
    if config is not None:
        store = open_store(config.output, config.s3_endpoint_url)
        record = truth.read_job(store, job) or JobRecord(config=config)
        return Recovery(config=config, record=record, adopted=catch_up(conn, config), rebuilt=False)
    if output is None:
        raise LookupError(f"job {job!r} is not in Redis: give the output it wrote to (--output)")
    on_disk = truth.read_job(open_store(output, endpoint_url), job)
    if on_disk is None:
        raise LookupError(f"job {job!r} is not in Redis and {output}/{job}/job.json does not exist: "
                          "nothing to recover it from")
    return rebuild(conn, on_disk)


def rebuild(conn: redis.Redis, record: JobRecord) -> Recovery:
    """Create the job again in Redis from its job.json and adopt every marker of its life."""
    config = record.config
    job = config.name
    store = open_store(config.output, config.s3_endpoint_url)
    written = truth.marker_batches(store, job)
    markers = truth.of_life(truth.read_markers(store, job, written), config)
    # Whatever Redis holds of the job without its config is not its ledger: results and claims
    # written into an empty Redis by workers that held batches when it was lost.
    orphans = list(conn.scan_iter(match=keys.job_keys_pattern(job), count=1000))
    top = max([record.reserved, *(batch_number(m.batch) for m in markers)], default=0)
    with conn.pipeline(transaction=True) as pipe:
        if orphans:
            pipe.delete(*orphans)
        stage_config(pipe, config)
        pipe.set(keys.job_batch_seq(job), top)
        pipe.execute()
    adopted = [m.batch for m in markers if adopt(conn, job, m)]
    log.warning("job %s was not in Redis: created again from %s (incarnation %s), %s adopted",
                job, truth.job_uri(store, job), config.incarnation, plural(len(adopted), "written batch", "written batches"))
    return Recovery(config=config, record=record, adopted=adopted, rebuilt=True, dropped_keys=len(orphans))


class OutputWatch:
    """Every worker's look at its jobs' outputs (run from its maintenance loop): after Redis
    restarted (its run_id changed) and once a minute, batches written but not done in Redis
    are adopted; a job that vanished from Redis while its output remains is named, with the
    command that brings it back."""

    EVERY_S = 60.0

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self._run_id: str | None = None
        self._last = 0.0
        self._outputs: dict[str, str] = {}  # job -> its output, as last seen
        self._missing: set[str] = set()

    def pass_once(self) -> None:
        run_id = str(self.conn.info("server").get("run_id"))
        restarted = self._run_id is not None and run_id != self._run_id
        if not restarted and time.monotonic() - self._last < self.EVERY_S:
            return
        self._run_id, self._last = run_id, time.monotonic()
        jobs = list_jobs(self.conn)
        for job in jobs:
            config = load_config(self.conn, job)
            if config is None:
                continue
            self._outputs[job] = config.output
            try:
                catch_up(self.conn, config)
            except Exception as exc:  # the output unreachable (disk, S3): next time
                log.warning("job %s: cannot read its output %s to check the ledger against it: %s",
                            job, config.output, exc)
        for job in sorted(set(self._outputs) - set(jobs) - self._missing):
            self._missing.add(job)
            log.error("job %s is gone from Redis (restarted empty or flushed?) but its output %s remains: "
                      "`genq recover --job %s --output %s` rebuilds it from there (or enqueue the same input "
                      "again)", job, self._outputs[job], job, self._outputs[job])
        self._missing &= set(self._outputs) - set(jobs)
