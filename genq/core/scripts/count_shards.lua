-- The running shard totals of a job whose shards an older genq wrote, counted once
-- (monitor/snapshot.py: O(its shards), once).
-- KEYS[1] = the job's shards (keys.job_shards)
-- KEYS[2] = the job's stats (keys.job_stats)
-- Returns 1 if it counted now, 0 if the totals were there already.
-- #include shard_totals
return count_shards(KEYS[1], KEYS[2])
