-- A piece of the claim scripts (claim, steal): `-- #include claim_helpers`.
-- A claim is "INSTANCE TOKEN" (worker/held.py): it counts while TOKEN is the batch's current
-- lease and INSTANCE's engine beats (its alive key ARGV[3] .. INSTANCE .. ARGV[4] exists).
-- KEYS[1] = the batch's claims (keys.batch_claims)
-- KEYS[2] = the batch's results (keys.batch_results)
-- KEYS[3] = the job's dead letters (keys.job_dlq)
-- KEYS[4] = the job's done batches (keys.job_done)
-- KEYS[5] = the job's leases (keys.job_leases)
-- KEYS[6] = the job's config (keys.job_config)
-- KEYS[7] = the batch's lost tries (keys.batch_tries)
-- ARGV[1] = batch id
-- ARGV[2] = me (this engine instance)
-- ARGV[3] = alive key prefix
-- ARGV[4] = alive key suffix
-- ARGV[5] = the incarnation the caller works for
-- #include incarnation
local function finished(id)
  return redis.call('HEXISTS', KEYS[2], id) == 1 or redis.call('HEXISTS', KEYS[3], id) == 1
end
-- The batch's current lease token, or nil (not leased: handed back, or never).
local function current_lease()
  local lease = redis.call('HGET', KEYS[5], ARGV[1])
  if not lease then return nil end
  return string.match(lease, '^(%S+)')
end
local function claimable(id, me, lease)
  local claim = redis.call('HGET', KEYS[1], id)
  if not claim then return true end
  local owner, token = string.match(claim, '^(%S+) (%S+)$')
  if not lease or token ~= lease then return true end  -- taken under a lease that is over: void
  return owner == me or redis.call('EXISTS', ARGV[3] .. owner .. ARGV[4]) == 0
end
-- Claim a claimable id for mine ("ME LEASE"); the tries lost on it so far: a claim there that
-- is not mine is one more (its engine stopped beating or its lease is over, its outcome never came).
local function take(id, mine)
  local claim = redis.call('HGET', KEYS[1], id)
  redis.call('HSET', KEYS[1], id, mine)
  if claim and claim ~= mine then return redis.call('HINCRBY', KEYS[7], id, 1) end
  return 0
end
