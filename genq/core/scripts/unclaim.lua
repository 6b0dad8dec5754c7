-- UNCLAIM: drop claims of mine in a batch made under one lease (worker/held.py). A let-go of an
-- older lease that runs late keeps what this engine claimed since under a newer lease of the batch.
-- KEYS[1] = the batch's claims (keys.batch_claims)
-- KEYS[2] = the job's config (keys.job_config)
-- ARGV[1] = me (this engine instance)
-- ARGV[2] = the incarnation the caller works for
-- ARGV[3] = the lease the claims were made under
-- ARGV[4..] = ids (none: every claim of mine under that lease in the batch)
-- Returns 0.
-- #include incarnation
if not incarnation_ok(KEYS[2], ARGV[2]) then return 0 end
local function mine(claim) return claim == ARGV[1] .. ' ' .. ARGV[3] end
if #ARGV > 3 then
  for i = 4, #ARGV do
    if mine(redis.call('HGET', KEYS[1], ARGV[i])) then redis.call('HDEL', KEYS[1], ARGV[i]) end
  end
  return 0
end
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if mine(all[i + 1]) then redis.call('HDEL', KEYS[1], all[i]) end
end
return 0
