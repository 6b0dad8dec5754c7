-- STEAL: claim prompts from the back of a batch another engine holds (worker/intake.py).
-- KEYS[1..7], ARGV[1..5]: as in _claim_helpers.lua
-- KEYS[8] = the holder's alive key (keys.engine_alive)
-- ARGV[6] = n, the most ids to claim
-- ARGV[7] = the batch's size
-- ARGV[8..] = ids, the back of the batch first
-- Returns {the ids claimed (at most n), the tries each had lost, the lease}, under the batch's current
-- lease: unclaimed ones, or claimed by an engine that stopped beating or under a lease that is over.
-- #include claim_helpers
if redis.call('SISMEMBER', KEYS[4], ARGV[1]) == 1 then return {} end
local lease = current_lease()
if not lease or not incarnation_ok(KEYS[6], ARGV[5]) then return {} end
-- Cheap answer for the common case (a live holder, every prompt claimed or finished).
if redis.call('EXISTS', KEYS[8]) == 1 and
   tonumber(ARGV[7]) - redis.call('HLEN', KEYS[1]) - redis.call('HLEN', KEYS[2]) <= 0 then
  return {}
end
local mine = ARGV[2] .. ' ' .. lease
local n, taken, lost = tonumber(ARGV[6]), {}, {}
for i = 8, #ARGV do
  if #taken >= n then break end
  local id = ARGV[i]
  if not finished(id) and redis.call('HGET', KEYS[1], id) ~= mine and claimable(id, ARGV[2], lease) then
    lost[#lost + 1] = take(id, mine)
    taken[#taken + 1] = id
  end
end
return {taken, lost, lease}
