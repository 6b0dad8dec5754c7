-- Put a popped batch of another model back at the tail of RQ's queue (worker/models.py), unless
-- it is in the queue already (RQ's own cleanup of the intermediate list may have moved it back).
-- KEYS[1] = RQ's intermediate list
-- KEYS[2] = RQ's queue
-- ARGV[1] = the RQ job id
-- Returns 1 if it was in the intermediate list, else 0.
local moved = redis.call('LREM', KEYS[1], 1, ARGV[1])
if moved == 1 or not redis.call('LPOS', KEYS[2], ARGV[1]) then
  redis.call('RPUSH', KEYS[2], ARGV[1])
end
return moved
