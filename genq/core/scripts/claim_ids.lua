-- Mark ids as queued with their content digests (genq/core/queueing.py), in the transaction
-- that writes their batches.
-- KEYS[1] = the job's ids (keys.job_ids)
-- ARGV[1] = the ids (msgpack list)
-- ARGV[2] = their values, 12 bytes each, one after the other: content digest and batch number
-- Returns the number of ids.
local ids, values = cmsgpack.unpack(ARGV[1]), ARGV[2]
for first = 1, #ids, 500 do
  local args = {}
  for i = first, math.min(first + 499, #ids) do
    args[#args + 1] = ids[i]
    args[#args + 1] = values:sub(i * 12 - 11, i * 12)
  end
  redis.call('HSET', KEYS[1], unpack(args))
end
return #ids
