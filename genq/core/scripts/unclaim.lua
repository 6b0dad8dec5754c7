-- UNCLAIM: drop claims of mine in a batch (worker/held.py).
-- KEYS[1] = the batch's claims (keys.batch_claims)
-- KEYS[2] = the job's config (keys.job_config)
-- ARGV[1] = me (this engine instance)
-- ARGV[2] = the incarnation the caller works for
-- ARGV[3..] = ids (none: every claim of mine in the batch)
-- Returns 0.
-- #include incarnation
if not incarnation_ok(KEYS[2], ARGV[2]) then return 0 end
local function mine(claim) return claim and string.match(claim, '^(%S+)') == ARGV[1] end
if #ARGV > 2 then
  for i = 3, #ARGV do
    if mine(redis.call('HGET', KEYS[1], ARGV[i])) then redis.call('HDEL', KEYS[1], ARGV[i]) end
  end
  return 0
end
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if mine(all[i + 1]) then redis.call('HDEL', KEYS[1], all[i]) end
end
return 0
