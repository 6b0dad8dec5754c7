-- A piece of other scripts: `-- #include publish_shard` (genq.core.scripts), the end RELEASE and
-- ADOPT share once they have decided that a written shard makes its batch done.
-- publish_shard(k, batch, info, reply_ttl, records, bytes, token, template): marks the batch done
-- (k.done), records its ShardInfo `info` (k.shards) and adds the shard's `records` and `bytes` to
-- the job's running totals (k.stats; counted first if not kept yet: shard_totals), deletes what the
-- batch no longer needs (k.results, k.record, k.claims, k.tries), tells "done" to the horses of
-- `token` ('' for none) and of the batch's current lease (k.leases) through their reply lists
-- (`template` with '{token}' replaced, kept `reply_ttl` s), and ends the lease and the transport
-- (k.leases, k.transport). k names the keys; the including script's header says which it passes.
-- #include shard_totals
local function publish_shard(k, batch, info, reply_ttl, records, bytes, token, template)
  redis.call('SADD', k.done, batch)
  count_shards(k.shards, k.stats)
  redis.call('HSET', k.shards, batch, info)
  redis.call('HINCRBY', k.stats, 'shard_records', tonumber(records))
  redis.call('HINCRBY', k.stats, 'shard_bytes', tonumber(bytes))
  redis.call('DEL', k.results, k.record, k.claims, k.tries)
  local tokens = {}
  if token ~= '' then tokens[1] = token end
  local lease = redis.call('HGET', k.leases, batch)
  if lease then
    local current = string.match(lease, '^(%S+)')
    if current ~= token then tokens[#tokens + 1] = current end
  end
  for _, t in ipairs(tokens) do
    local reply = string.gsub(template, '{token}', t)
    redis.call('RPUSH', reply, 'done')
    redis.call('EXPIRE', reply, tonumber(reply_ttl))
  end
  redis.call('HDEL', k.leases, batch)
  redis.call('HDEL', k.transport, batch)
end
