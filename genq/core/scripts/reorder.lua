-- Put RQ's queue in scheduling order (genq/core/order.py) without losing or doubling an id:
-- ids in the queue and in ARGV go first, in ARGV's order; ids in the queue only (pushed
-- meanwhile, or not genq's) after them, in their order.
-- KEYS[1] = RQ's queue
-- ARGV[1..n] = RQ job ids in the wanted order
-- Returns 1 if the queue was rewritten, 0 if it was in that order already.
local current = redis.call('LRANGE', KEYS[1], 0, -1)
local present = {}
for _, id in ipairs(current) do present[id] = true end
local out, placed = {}, {}
for _, id in ipairs(ARGV) do
  if present[id] and not placed[id] then out[#out + 1] = id; placed[id] = true end
end
for _, id in ipairs(current) do
  if not placed[id] then out[#out + 1] = id end
end
local same = #out == #current
for i = 1, #out do if out[i] ~= current[i] then same = false; break end end
if same then return 0 end
redis.call('DEL', KEYS[1])
for first = 1, #out, 1000 do
  redis.call('RPUSH', KEYS[1], unpack(out, first, math.min(first + 999, #out)))
end
return 1
