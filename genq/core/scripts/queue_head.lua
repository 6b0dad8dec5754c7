-- What RQ's queue hands out next (genq/core/order.py, worker/intake.py).
-- KEYS[1] = RQ's queue
-- ARGV[1] = RQ's job key prefix (RQ_JOB_PREFIX)
-- Returns the description of the queue's first RQ job, or nil (an empty queue).
local id = redis.call('LINDEX', KEYS[1], 0)
if not id then return false end
return redis.call('HGET', ARGV[1] .. id, 'description')
