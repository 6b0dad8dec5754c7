-- RELEASE: mark a batch done with its written shard (worker/batches.py), once. Adds the
-- shard to the job's running totals; the RQ job that carried it leaves RQ. Never for a shard
-- that is not the outcomes Redis holds: the same result ids, each stored at the size the shard
-- read it (another writer's answer after a rollback differs in size; their counters are the
-- shard's then), and each of its dead letters still in the DLQ (a letter lost with a rollback
-- would be in no DLQ once the batch is done, and the job never end). A count alone would take a
-- rolled-back letter, or another writer's outcomes of the same number, for the shard. Sizes, not
-- the bytes: hashing a batch's answers here cost Redis 25 ms a release at 10 KB an answer (2026-12-07).
-- KEYS[1] = the job's done batches (keys.job_done)
-- KEYS[2] = the job's shards (keys.job_shards)
-- KEYS[3] = the batch's results (keys.batch_results)
-- KEYS[4] = the batch's record (keys.batch)
-- KEYS[5] = the job's leases (keys.job_leases)
-- KEYS[6] = the job's transport (keys.job_transport)
-- KEYS[7] = the job's stats (keys.job_stats)
-- KEYS[8] = the batch's claims (keys.batch_claims)
-- KEYS[9] = the job's config (keys.job_config)
-- KEYS[10] = the batch's lost tries (keys.batch_tries)
-- ARGV[1] = batch id
-- ARGV[2] = ShardInfo (msgpack)
-- KEYS[11] = RQ's started registry of genq's queue
-- ARGV[3] = the shard's records
-- ARGV[4] = the shard's bytes
-- ARGV[5] = the job's incarnation
-- ARGV[6] = RQ's job hash prefix (scripts.RQ_JOB_PREFIX)
-- ARGV[7] = RQ's execution id of genq's started entries (scripts.RQ_EXECUTION)
-- ARGV[8] = the shard's result ids (lua_list)
-- ARGV[9] = the byte size of each one's stored value as read from KEYS[3] (lua_list, ARGV[8]'s order)
-- ARGV[10] = the shard's dead letter ids (lua_list)
-- KEYS[12] = the job's dead letters (keys.job_dlq)
-- Returns 0 (done already), 1 (released now), 'gone' (another incarnation of the job, or none),
-- 'short' (Redis holds other outcomes than the shard: lost, rolled back or written again meanwhile).
-- #include publish_shard
-- #include incarnation
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 0 end
if not incarnation_ok(KEYS[9], ARGV[5]) then return 'gone' end
local function same_outcomes()
  local ids, sizes = cmsgpack.unpack(ARGV[8]), cmsgpack.unpack(ARGV[9])
  if redis.call('HLEN', KEYS[3]) ~= tonumber(ARGV[3]) or #ids ~= tonumber(ARGV[3]) then return false end
  for i = 1, #ids do  -- HSTRLEN reads no value: a batch's megabytes of answers are not copied here
    if redis.call('HSTRLEN', KEYS[3], ids[i]) ~= tonumber(sizes[i]) then return false end
  end
  for _, id in ipairs(cmsgpack.unpack(ARGV[10])) do
    if redis.call('HEXISTS', KEYS[12], id) == 0 then return false end
  end
  return true
end
if not same_outcomes() then return 'short' end
-- Totals not kept yet (a job's first shard, or a job of an older genq): publish_shard counts what
-- is there before this shard (nothing, for a new job), then adds this one.
publish_shard({done = KEYS[1], shards = KEYS[2], results = KEYS[3], record = KEYS[4], leases = KEYS[5],
               transport = KEYS[6], stats = KEYS[7], claims = KEYS[8], tries = KEYS[10], started = KEYS[11]},
              ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[6], ARGV[7])
return 1
