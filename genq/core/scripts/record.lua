-- RECORD: commit a group of one batch's outcomes, with their counters (worker/results.py).
-- One final state per prompt, first writer wins: a result is kept only if the prompt has no
-- result and no dead letter yet, a dead letter only if it has neither; the counters move only
-- for what was kept, so they always equal what is stored. A group costs a fixed dozen commands
-- or so, not a few per prompt (issue #29): the outcomes already stored are read with one HMGET
-- per hash, the new ones written with one HSET, their claims ended with one HDEL, the histogram
-- with one HINCRBY per length bucket.
-- KEYS[1] = the batch's results (keys.batch_results)
-- KEYS[2] = the job's done batches (keys.job_done)
-- KEYS[3] = this worker's stats for the job (keys.worker_stats)
-- KEYS[4] = the job's length histogram (keys.job_hist)
-- KEYS[5] = the job's dead letters (keys.job_dlq)
-- KEYS[6] = the job's workers (keys.job_workers)
-- KEYS[7] = the batch's claims (keys.batch_claims)
-- KEYS[8] = the job's config (keys.job_config)
-- KEYS[9] = the batch's record (keys.batch)
-- ARGV[1] = batch id
-- ARGV[2] = worker name
-- ARGV[3] = now (epoch seconds)
-- ARGV[4] = the incarnation the outcomes were generated for
-- ARGV[5] = results, flat (lua_list): id, result (msgpack), in_tok, out_tok, length bucket, ...
-- ARGV[6] = dead letters, flat (lua_list): id, letter (msgpack), ...
-- ARGV[7] = first sent: when the earliest request of these outcomes was sent (the worker's first_at)
-- Returns {added, dead}; {-1, -1}: the batch is done; {-2, -2}: not the job's incarnation, or a batch the
-- ledger does not have (Redis lost it and the same enqueue queued its prompts in other batches, which
-- count them): nothing written.
-- #include incarnation
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
if not incarnation_ok(KEYS[8], ARGV[4]) or redis.call('EXISTS', KEYS[9]) == 0 then return {-2, -2} end
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
-- Every prompt written here has its outcome now: its claim (worker/held.py) is over.
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
