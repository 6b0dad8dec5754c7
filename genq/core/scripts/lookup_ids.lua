-- Which ids a job has queued already, and with which content (genq/core/queueing.py).
-- keys.job_ids maps each queued id to its content digest (8 raw bytes; genq 0.1 wrote 16 hex
-- characters), then its batch's number (4 bytes, where a newer genq wrote it). Two arguments for
-- thousands of ids, not two per id (packing those was a third of the producer's time).
-- KEYS[1] = the job's ids (keys.job_ids)
-- ARGV[1] = the ids (msgpack list)
-- ARGV[2] = their digests, 8 bytes each, one after the other
-- Returns one character per id: '0' not queued, '1' queued with this content, '2' with other content.
local ids, digests = cmsgpack.unpack(ARGV[1]), ARGV[2]
local out = {}
for first = 1, #ids, 1000 do
  local last = math.min(first + 999, #ids)
  local stored = redis.call('HMGET', KEYS[1], unpack(ids, first, last))
  for i = first, last do
    local v = stored[i - first + 1]
    if not v then
      out[i] = '0'
    else
      local digest = digests:sub(i * 8 - 7, i * 8)
      if (#v ~= 16 and v:sub(1, 8) == digest) or (#v == 16 and v == (digest:gsub('.', function(c)
          return string.format('%02x', c:byte()) end))) then
        out[i] = '1'
      else
        out[i] = '2'
      end
    end
  end
end
return table.concat(out)
