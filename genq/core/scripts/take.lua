-- TAKE: an engine takes the first batch of RQ's queue that it may run, and leases it: the RQ job
-- leaves the queue for RQ's started registry under this engine's name (what `rq info` shows),
-- and the lease is the batch's current one. Batches of the jobs in ARGV[12..] are
-- left where they are (another model's, or shards that cannot be written here now).
-- KEYS[1] = RQ's queue (rq:queue:genq)
-- KEYS[2] = RQ's started registry of that queue
-- KEYS[3] = RQ's suspension flag (`rq suspend`, `genq pause`)
-- KEYS[4] = what this engine took last (keys.engine_took): "TOKEN JOB BATCH RQID"
-- ARGV[1] = engine instance (its RQ worker name)
-- ARGV[2] = lease token
-- ARGV[3] = now, as RQ writes it (started_at)
-- ARGV[4] = how many queued RQ jobs to look at, at most
-- ARGV[5] = the started registry's member suffix (RQ's execution id: scripts.RQ_EXECUTION)
-- ARGV[6] = RQ's job hash prefix (scripts.RQ_JOB_PREFIX)
-- ARGV[7..10] = keys.job_done, keys.batch, keys.job_transport, keys.job_leases with '{job}' and
--              '{batch}' where the names go (keys.py stays their one definition)
-- ARGV[11] = how long KEYS[4] is kept, seconds
-- ARGV[12..] = jobs to leave in the queue
-- Returns {job, batch, rq job id} of the batch leased, or nil (nothing to take).
-- RQ jobs of done batches, or of batches with no record, or superseded by a newer RQ job of the
-- same batch (keys.job_transport), leave the queue and RQ as they are met.
-- The same call sent again (a write a failing-over Redis did not confirm is resent: genq.core.
-- redisconn) answers what the first took, if that landed, rather than leasing a second batch
-- that the engine would never hear of.
-- The lease: 'done' (in `done`), 'gone' (no `record`: the job was deleted), or 'ok': "TOKEN
-- INSTANCE" is now the batch's current lease (`leases`), whatever was, and `rq_id` the RQ job
-- that carries it (`transport`).
local function lease(done, leases, transport, record, batch, token, instance, rq_id)
  if redis.call('SISMEMBER', done, batch) == 1 then return 'done' end
  if redis.call('EXISTS', record) == 0 then return 'gone' end
  redis.call('HSET', leases, batch, token .. ' ' .. instance)
  redis.call('HSET', transport, batch, rq_id)
  return 'ok'
end
local last = redis.call('GET', KEYS[4])
if last then
  local token, job, batch, id = string.match(last, '^(%S+) (%S+) (%S+) (%S+)$')
  if token == ARGV[2] then return {job, batch, id} end
end
if redis.call('EXISTS', KEYS[3]) == 1 then return nil end
local skip = {}
for i = 12, #ARGV do skip[ARGV[i]] = true end
local function key(template, job, batch)
  return (string.gsub(string.gsub(template, '{job}', function() return job end), '{batch}',
                      function() return batch end))
end
for _, id in ipairs(redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[4]) - 1)) do
  local hash = ARGV[6] .. id
  local text = redis.call('HGET', hash, 'description')
  local job, batch = nil, nil
  if text then job, batch = string.match(text, '^genq batch ([^/]+)/(%S+)') end
  if not job then
    -- Not a genq batch (no hash, another app's job): RQ itself would skip a job without a hash.
    if not text then redis.call('LREM', KEYS[1], 1, id) end
  elseif not skip[job] then
    local transport = redis.call('HGET', key(ARGV[9], job), batch)
    redis.call('LREM', KEYS[1], 1, id)
    local leased = 'superseded'
    if not transport or transport == id then
      leased = lease(key(ARGV[7], job), key(ARGV[10], job), key(ARGV[9], job), key(ARGV[8], job, batch),
                     batch, ARGV[2], ARGV[1], id)
    end
    if leased == 'ok' then
      redis.call('ZADD', KEYS[2], '+inf', id .. ':' .. ARGV[5])
      redis.call('HSET', hash, 'status', 'started', 'started_at', ARGV[3], 'worker_name', ARGV[1])
      redis.call('SET', KEYS[4], ARGV[2] .. ' ' .. job .. ' ' .. batch .. ' ' .. id, 'EX', tonumber(ARGV[11]))
      return {job, batch, id}
    end
    redis.call('DEL', hash)
  end
end
return nil
