-- A piece of other scripts: `-- #include shard_totals` (genq.core.scripts).
-- count_shards(shards, stats): when stats (keys.job_stats) has no running shard totals yet (a new
-- job, or one whose shards an older genq wrote), count every ShardInfo in shards
-- (keys.job_shards) once and store the sums; 1 if it counted now, 0 if the totals were there.
-- The totals' fields are ledger.SHARD_RECORDS and ledger.SHARD_BYTES (tests/test_scripts.py
-- holds them to the names here): RELEASE and ADOPT add each shard to them in the call that
-- records it, so they always equal the sums over the shards and the monitor reads them instead
-- of every ShardInfo.
local function count_shards(shards, stats)
  if redis.call('HEXISTS', stats, 'shard_records') == 1 then return 0 end
  local records, bytes = 0, 0
  for _, blob in ipairs(redis.call('HVALS', shards)) do
    local info = cmsgpack.unpack(blob)
    records = records + (info['records'] or 0)
    bytes = bytes + (info['bytes'] or 0)
  end
  redis.call('HSET', stats, 'shard_records', records, 'shard_bytes', bytes)
  return 1
end
