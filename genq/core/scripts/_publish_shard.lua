-- A piece of other scripts: `-- #include publish_shard` (genq.core.scripts), the end RELEASE and
-- ADOPT share once they have decided that a written shard makes its batch done.
-- publish_shard(k, batch, info, records, bytes, rq_prefix, execution): marks the batch done
-- (k.done), records its ShardInfo `info` (k.shards) and adds the shard's `records` and `bytes` to
-- the job's running totals (k.stats; counted first if not kept yet: shard_totals), deletes what the
-- batch no longer needs (k.results, k.record, k.claims, k.tries), ends the lease (k.leases) and the
-- transport (k.transport): the RQ job that carried the batch leaves RQ (its hash, `rq_prefix` ..
-- id, and its entry `id:execution` in RQ's started registry k.started), so `rq info` shows it no
-- more. k names the keys; the including script's header says which it passes.
-- #include shard_totals
local function publish_shard(k, batch, info, records, bytes, rq_prefix, execution)
  redis.call('SADD', k.done, batch)
  count_shards(k.shards, k.stats)
  redis.call('HSET', k.shards, batch, info)
  redis.call('HINCRBY', k.stats, 'shard_records', tonumber(records))
  redis.call('HINCRBY', k.stats, 'shard_bytes', tonumber(bytes))
  redis.call('DEL', k.results, k.record, k.claims, k.tries)
  local rq_id = redis.call('HGET', k.transport, batch)
  if rq_id then
    redis.call('DEL', rq_prefix .. rq_id)
    redis.call('ZREM', k.started, rq_id .. ':' .. execution)
  end
  redis.call('HDEL', k.leases, batch)
  redis.call('HDEL', k.transport, batch)
end
