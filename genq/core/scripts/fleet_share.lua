-- FLEET_SHARE: publish this engine's prompts of each job (claimed, or in flight) and read the
-- fleet's other engines' (worker/intake.py: the fair share is kept over the fleet, not per engine).
-- KEYS[1] = a job's share hash (keys.job_share): engine instance -> "REDIS_SECONDS COUNT";
--           KEYS[2], ... the same for each further job
-- ARGV[1] = me (this engine instance)
-- ARGV[2] = seconds an entry counts: an engine that stopped refreshing is dropped after this
-- ARGV[3] = my count for KEYS[1] (0: my entry goes); ARGV[4], ... for KEYS[2], ...
-- Returns, per key, the sum of the other engines' fresh counts. Redis's clock dates the entries:
-- the engines' clocks may disagree.
local now = tonumber(redis.call('TIME')[1])
local fresh = tonumber(ARGV[2])
local out = {}
for i, key in ipairs(KEYS) do
  local mine = tonumber(ARGV[i + 2])
  if mine > 0 then
    redis.call('HSET', key, ARGV[1], now .. ' ' .. mine)
    redis.call('EXPIRE', key, 10 * fresh)  -- a job gone leaves nothing behind
  else
    redis.call('HDEL', key, ARGV[1])
  end
  local sum = 0
  local all = redis.call('HGETALL', key)
  for j = 1, #all, 2 do
    if all[j] ~= ARGV[1] then
      local at, n = string.match(all[j + 1], '^(%d+) (%d+)$')
      if at and now - tonumber(at) <= fresh then
        sum = sum + tonumber(n)
      else
        redis.call('HDEL', key, all[j])
      end
    end
  end
  out[i] = sum
end
return out
