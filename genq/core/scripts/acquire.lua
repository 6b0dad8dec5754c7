-- ACQUIRE: record a lease (worker/leases.py) as the batch's current one and the RQ job that
-- carried it, unless the batch is done or its record is gone.
-- KEYS[1] = the job's done batches (keys.job_done)
-- KEYS[2] = the job's leases (keys.job_leases)
-- KEYS[3] = the job's transport (keys.job_transport)
-- KEYS[4] = the batch's record (keys.batch)
-- ARGV[1] = batch id
-- ARGV[2] = lease token
-- ARGV[3] = engine instance
-- ARGV[4] = RQ job id
-- Returns 'ok' (this lease is now the batch's), 'done', or 'gone' (no record: the job was deleted).
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 'done' end
if redis.call('EXISTS', KEYS[4]) == 0 then return 'gone' end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. ' ' .. ARGV[3])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
return 'ok'
