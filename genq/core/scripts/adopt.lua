-- ADOPT: mark a written batch done from its marker (genq/ops/recover.py), exactly as RELEASE
-- would, and set the counters to what the shard holds: what Redis had counted for the batch's
-- stored results is taken back, the marker's tally counted instead.
-- KEYS[1] = the job's done batches (keys.job_done)
-- KEYS[2] = the job's shards (keys.job_shards)
-- KEYS[3] = the batch's results (keys.batch_results)
-- KEYS[4] = the batch's record (keys.batch)
-- KEYS[5] = the job's leases (keys.job_leases)
-- KEYS[6] = the job's transport (keys.job_transport)
-- KEYS[7] = the job's stats (keys.job_stats)
-- KEYS[8] = the batch's claims (keys.batch_claims)
-- KEYS[9] = the job's length histogram (keys.job_hist)
-- KEYS[10] = the job's dead letters (keys.job_dlq)
-- KEYS[11] = the job's workers (keys.job_workers)
-- KEYS[12] = the job's batches (keys.job_batches)
-- KEYS[13] = the job's ids (keys.job_ids)
-- KEYS[14] = the job's config (keys.job_config)
-- KEYS[15] = the batch's lost tries (keys.batch_tries)
-- KEYS[16] = RQ's started registry of genq's queue
-- ARGV[1] = batch id
-- ARGV[2] = ShardInfo (msgpack)
-- ARGV[3] = RQ's job hash prefix (scripts.RQ_JOB_PREFIX)
-- ARGV[4] = RQ's execution id of genq's started entries (scripts.RQ_EXECUTION)
-- ARGV[5] = the shard's records
-- ARGV[6] = the shard's bytes
-- ARGV[7] = the worker-stats key prefix (keys.worker_stats(job, ""))
-- ARGV[8] = tally {worker: [results, in_tok, out_tok]} (msgpack)
-- ARGV[9] = length histogram {bucket: n} (msgpack)
-- ARGV[10] = dead letters [[id, letter hex, worker]] (msgpack)
-- ARGV[11] = digests {id: hex} (msgpack)
-- ARGV[12] = the batch's number (its score in keys.job_batches)
-- ARGV[13] = the incarnation that wrote the shard
-- Returns 0 (done already), 1 (adopted), 'gone' (the job is not in Redis as the life that wrote the shard).
-- #include publish_shard
-- #include incarnation
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 0 end
if not incarnation_ok(KEYS[14], ARGV[13]) then return 'gone' end
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
-- The shard's prompts this Redis has not counted in the job's total: those new to its id index,
-- and those the marker has no digest of (a shard of an older genq).
local unknown = tonumber(ARGV[5]) + #cmsgpack.unpack(ARGV[10])
for id, hex in pairs(cmsgpack.unpack(ARGV[11])) do
  local letter = not dead[id] and redis.call('HGET', KEYS[10], id)
  if letter then  -- the shard has its result: the letter goes, off its worker's count
    redis.call('HDEL', KEYS[10], id)
    redis.call('HINCRBY', wstats(cmsgpack.unpack(letter)['worker']), 'failed', -1)
  end
  unknown = unknown - 1 + redis.call('HSETNX', KEYS[13], id, unhex(hex) .. struct.pack('>I4', tonumber(ARGV[12])))
end
if redis.call('EXISTS', KEYS[4]) == 0 and not redis.call('ZSCORE', KEYS[12], ARGV[1]) then
  -- A batch this Redis never saw (it was lost with the rest): part of the job again. Its prompts
  -- count in the total only if Redis did not know them (a requeue's batch: they were letters).
  redis.call('ZADD', KEYS[12], tonumber(ARGV[12]), ARGV[1])
  redis.call('HINCRBY', KEYS[7], 'total', unknown)
  redis.call('HINCRBY', KEYS[7], 'batches', 1)
end
publish_shard({done = KEYS[1], shards = KEYS[2], results = KEYS[3], record = KEYS[4], leases = KEYS[5],
               transport = KEYS[6], stats = KEYS[7], claims = KEYS[8], tries = KEYS[15], started = KEYS[16]},
              ARGV[1], ARGV[2], ARGV[5], ARGV[6], ARGV[3], ARGV[4])
return 1
