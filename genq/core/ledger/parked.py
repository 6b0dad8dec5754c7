"""Parked batches: a paused or blocked job's batches that no RQ job carries (worker/parking.py
parks the held ones; unqueue takes the queued ones out of RQ's queue), and their way back
(`genq resume --job`). Not stranded: the reconciler leaves a paused or blocked job's batches be.
"""

from __future__ import annotations

import redis
from rq.results import Result as RqResult

from genq.core import keys
from genq.core.ledger.leasing import end_lease_if_ours
from genq.core.queueing import carried, enqueue_batch_jobs, fetch_rq_jobs, rq_queue
from genq.core.records import BatchRef


def unqueue(conn: redis.Redis, job: str) -> int:
    """Take the blocked job's batches out of RQ's queue (they are parked like the held ones: no RQ
    job carries them, `genq resume --job` queues them again), so that workers do not take them one
    by one only to park them, and other jobs' batches behind them are not kept waiting. How many."""
    queue = rq_queue(conn)
    ids = queue.get_job_ids()
    found = {j.id: j for j in fetch_rq_jobs(conn, ids) if j is not None and (c := carried(j)) and c[0] == job}
    mine = [(rq_id, carried(j)[1]) for rq_id, j in found.items()]  # type: ignore[index]
    if not mine:
        return 0
    with conn.pipeline(transaction=False) as pipe:
        for rq_id, _ in mine:
            pipe.lrem(queue.key, 0, rq_id)
        removed = pipe.execute()
    # Only what left the queue here: a loop that took one meanwhile delivers it, and its engine parks it.
    gone = [(rq_id, batch) for (rq_id, batch), n in zip(mine, removed) if n]
    carriers = conn.hmget(keys.job_transport(job), [batch for _, batch in gone]) if gone else []
    with conn.pipeline(transaction=True) as pipe:
        for (rq_id, batch), carrier in zip(gone, carriers):
            if carrier is not None and carrier.decode() == rq_id:
                pipe.hdel(keys.job_transport(job), batch)
        # Out of the queue, such a job is in no registry of RQ's: its keys go. RQ's own delete would
        # first ask Redis for its status seven times, one round trip each: `genq pause --job` of a
        # job with 1,250 queued batches took 17 s of its 18 s in them (2026-12-06).
        for rq_id, _ in gone:
            rq_job = found[rq_id]
            pipe.delete(rq_job.key, rq_job.dependents_key, rq_job.dependencies_key, RqResult.get_key(rq_id))
        pipe.execute()
    return len(gone)


def requeue_parked(conn: redis.Redis, job: str) -> int:
    """Queue every batch of `job` that is not done and that no RQ job carries (a blocked job's
    workers parked it: worker/parking.py). WATCH on the transport makes a reconciler or a second
    resume that queues one meanwhile start this over, so none is queued twice."""
    transport = keys.job_transport(job)

    def queue(pipe: redis.client.Pipeline) -> int:
        batches = [b.decode() for b in pipe.zrange(keys.job_batches(job), 0, -1)]
        done = {b.decode() for b in pipe.smembers(keys.job_done(job))}
        pending = [b for b in batches if b not in done]
        carried = pipe.hmget(transport, pending) if pending else []
        parked = [b for b, t in zip(pending, carried) if t is None and pipe.exists(keys.batch(job, b))]
        pipe.multi()
        if parked:
            enqueue_batch_jobs(pipe, conn, [(job, b, 0) for b in parked], at_front=True)
        return len(parked)

    return int(conn.transaction(queue, transport, keys.job_done(job), value_from_callable=True))


def end_lease_parked(conn: redis.Redis, ref: BatchRef, token: str) -> bool:
    """End this lease with no RQ job carrying the batch; False if it was done or not ours."""
    return end_lease_if_ours(conn, ref, token, lambda pipe: pipe.hdel(keys.job_transport(ref.job), ref.batch))
