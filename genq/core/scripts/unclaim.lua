-- UNCLAIM: drop claims of mine in a batch (worker/held.py), except those made under the batch's current
-- lease when that is not the lease given: a let-go of an older lease that runs late keeps what this engine
-- claimed since under a newer one, and still clears its void claims (whose takeover would count a lost try).
-- KEYS[1] = the batch's claims (keys.batch_claims)
-- KEYS[2] = the job's config (keys.job_config)
-- KEYS[3] = the job's leases (keys.job_leases)
-- ARGV[1] = me (this engine instance)
-- ARGV[2] = the incarnation the caller works for
-- ARGV[3] = the lease the claims were made under
-- ARGV[4] = batch id
-- ARGV[5..] = ids (none: every claim of mine in the batch)
-- Returns 0.
-- #include incarnation
if not incarnation_ok(KEYS[2], ARGV[2]) then return 0 end
local current = string.match(redis.call('HGET', KEYS[3], ARGV[4]) or '', '^(%S+)')
local function mine(claim)
  local owner, token = string.match(claim or '', '^(%S+) (%S+)$')
  return owner == ARGV[1] and (token == ARGV[3] or token ~= current)
end
if #ARGV > 4 then
  for i = 5, #ARGV do
    if mine(redis.call('HGET', KEYS[1], ARGV[i])) then redis.call('HDEL', KEYS[1], ARGV[i]) end
  end
  return 0
end
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if mine(all[i + 1]) then redis.call('HDEL', KEYS[1], all[i]) end
end
return 0
