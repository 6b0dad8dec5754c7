-- A piece of other scripts: `-- #include lease` (genq.core.scripts), the lease that TAKE gives
-- the batch it takes, and ACQUIRE gives a batch delivered any other way (tests and benches).
-- lease(done, leases, transport, record, batch, token, instance, rq_id): 'done' (in `done`),
-- 'gone' (no `record`: the job was deleted), or 'ok': "TOKEN INSTANCE" is now the batch's current
-- lease (`leases`), whatever was, and `rq_id` the RQ job that carries it (`transport`).
local function lease(done, leases, transport, record, batch, token, instance, rq_id)
  if redis.call('SISMEMBER', done, batch) == 1 then return 'done' end
  if redis.call('EXISTS', record) == 0 then return 'gone' end
  redis.call('HSET', leases, batch, token .. ' ' .. instance)
  redis.call('HSET', transport, batch, rq_id)
  return 'ok'
end
