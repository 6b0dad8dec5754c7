-- CLAIM: claim prompts of a held batch to send them (worker/held.py). A fixed handful of
-- commands a call, whatever its number of ids (issue #29): outcomes and claims read with one
-- HMGET per hash, the claims written with one HSET, each other live owner's alive key read
-- once; only a take-over of a void claim touches the tries hash (ux's lost tries).
-- KEYS[1..7], ARGV[1..5]: as in _claim_helpers.lua
-- ARGV[6] = my lease token
-- ARGV[7] = the ids (lua_list)
-- Returns 'done'; 'stale' (not this incarnation, or not my lease: the lease check decides);
-- or {one letter per id: c (claimed: send it), t (taken by another live engine), f (finished),
-- then (position, tries lost) for each claimed id that has lost any}.
-- #include claim_helpers
local CHUNK = 1000  -- fields per HMGET/HSET (Lua's unpack has a stack limit)
local function hmget(key, ids)
  local out = {}
  for first = 1, #ids, CHUNK do
    local got = redis.call('HMGET', key, unpack(ids, first, math.min(#ids, first + CHUNK - 1)))
    for j = 1, #got do out[#out + 1] = got[j] end  -- false where the field is missing
  end
  return out
end

if redis.call('SISMEMBER', KEYS[4], ARGV[1]) == 1 then return 'done' end
local lease = current_lease()
if lease ~= ARGV[6] or not incarnation_ok(KEYS[6], ARGV[5]) then return 'stale' end
local mine = ARGV[2] .. ' ' .. lease
local ids = cmsgpack.unpack(ARGV[7])
local results, letters, claims = hmget(KEYS[2], ids), hmget(KEYS[3], ids), hmget(KEYS[1], ids)
local beating = {}  -- owner -> its engine beats (one EXISTS per other owner)
local function free(claim)  -- claimable(), on a claim already read
  if not claim then return true end
  local owner, token = string.match(claim, '^(%S+) (%S+)$')
  if token ~= lease or owner == ARGV[2] then return true end  -- void (another lease's), or mine
  if beating[owner] == nil then
    beating[owner] = redis.call('EXISTS', ARGV[3] .. owner .. ARGV[4]) == 1
  end
  return not beating[owner]
end
local out, answer, writes, taken_over = {}, {''}, {}, {}
for k, id in ipairs(ids) do
  if results[k] or letters[k] then
    out[k] = 'f'
  elseif free(claims[k]) then
    writes[#writes + 1] = id
    writes[#writes + 1] = mine
    if claims[k] and claims[k] ~= mine then taken_over[#taken_over + 1] = k end
    out[k] = 'c'
  else
    out[k] = 't'
  end
end
for first = 1, #writes, 2 * CHUNK do
  redis.call('HSET', KEYS[1], unpack(writes, first, math.min(#writes, first + 2 * CHUNK - 1)))
end
-- A claim there that was not mine is one more try lost (its engine stopped beating or its lease
-- is over, its outcome never came): as take() counts it for STEAL.
for _, k in ipairs(taken_over) do
  answer[#answer + 1] = k
  answer[#answer + 1] = redis.call('HINCRBY', KEYS[7], ids[k], 1)
end
answer[1] = table.concat(out)
return answer
