"""Parked batches: a paused or blocked job's batches that no RQ job carries (worker/gate.py parks
the held ones, unqueue the queued ones), and their way back (`genq resume --job`). The reconciler
leaves them be."""

from __future__ import annotations

import redis
from rq.results import Result as RqResult

from genq.core import keys
from genq.core.ledger.leasing import end_lease_if_ours
from genq.core.queueing import carried, enqueue_batch_jobs, fetch_rq_jobs, rq_queue
from genq.core.records import BatchRef


def unqueue(conn: redis.Redis, job: str) -> int:
    """Park the job's queued batches: out of RQ's queue, so that workers do not take them one by one
    only to park them, nor keep other jobs' batches waiting behind them. How many."""
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
        # Out of the queue, such a job is in no registry of RQ's: its keys go (not RQ's delete, which
        # asks Redis for its status seven times, a round trip each).
        for rq_id, _ in gone:
            rq_job = found[rq_id]
            pipe.delete(rq_job.key, rq_job.dependents_key, rq_job.dependencies_key, RqResult.get_key(rq_id))
        pipe.execute()
    return len(gone)


def requeue_parked(conn: redis.Redis, job: str) -> int:
    """Queue every batch of `job` not done that no RQ job carries; WATCH on the transport starts this
    over if another resume or a reconciler queues one meanwhile, so none is queued twice."""
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
