-- Mark ids as queued with their content digests (genq/core/queueing.py), in the transaction
-- that writes their batches.
-- KEYS[1] = the job's ids (keys.job_ids)
-- ARGV[1] = the ids (msgpack list)
-- ARGV[2] = their digests, 8 bytes each, one after the other
-- Returns the number of ids.
local ids, digests = cmsgpack.unpack(ARGV[1]), ARGV[2]
for first = 1, #ids, 500 do
  local args = {}
  for i = first, math.min(first + 499, #ids) do
    args[#args + 1] = ids[i]
    args[#args + 1] = digests:sub(i * 8 - 7, i * 8)
  end
  redis.call('HSET', KEYS[1], unpack(args))
end
return #ids
