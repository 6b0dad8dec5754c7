"""Which batch RQ hands out next: priorities and fair share over RQ's one queue (docs/scheduling.md).

Every job has a JobSchedule (priority, weight; stored by genq.core.ledger.jobs). RQ's queue `genq` is kept in
scheduling order: the batches of the highest priority first; among jobs of equal priority, one
batch of each in turn (weighted: a job of weight 2 gets two turns to one), counting the batches
each has already been given, so a job queued later is not stuck behind one queued earlier.
`order_queue` rewrites the list in that order, in one script (REORDER) that keeps every id it finds there
(one popped meanwhile is simply not there; one pushed meanwhile goes after the ordered ones):
nothing is lost or queued twice, only moved. It runs after every change that can put a batch
out of order (enqueue, `genq jobs set --priority`, resume) and in the reconciler's pass.

`head_of_queue` tells an engine what the queue's next batch is (its job), so an engine whose
loops all hold batches of lower priority takes one more (worker/loops.py).
"""

from __future__ import annotations

import time

import redis

from genq.core import scripts
from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger.jobs import schedule_of as schedule_of  # where worker/shares.py reads it
from genq.core.ledger.jobs import schedules
from genq.core.records import JobSchedule
from genq.core.scripts import RQ_JOB_PREFIX

DESCRIPTION = "genq batch "  # genq.core.queueing: "genq batch JOB/BATCH (N prompts)"


def set_schedule(conn: redis.Redis, job: str, priority: int | None = None, weight: float | None = None) -> JobSchedule:
    """Store the job's priority and/or weight (the others kept) and put the queue in order again."""
    if weight is not None and not weight > 0:
        raise ValueError("a weight is > 0")
    def change(old: JobSchedule) -> JobSchedule:
        return JobSchedule(priority=old.priority if priority is None else priority,
                           weight=old.weight if weight is None else weight, changed_at=time.time())

    new = ledger_jobs.change_schedule(conn, job, change)
    order_queue(conn)
    return new


def batch_of_description(description: bytes | str | None) -> tuple[str, str] | None:
    """(job, batch) from an RQ job's description; None if it is not one of genq's batches."""
    if description is None:
        return None
    text = description.decode() if isinstance(description, bytes) else description
    if not text.startswith(DESCRIPTION):
        return None
    ref = text[len(DESCRIPTION):].split(" ", 1)[0]
    job, _, batch = ref.partition("/")
    return (job, batch) if job and batch else None


def interleave(queued: dict[str, list[str]], given: dict[str, int], sched: dict[str, JobSchedule]) -> list[str]:
    """Jobs' queued items in scheduling order: priority first, then weighted turns counting what
    each job was given already (`given`: batches out of the queue). Each job's items keep their order."""
    order: list[str] = []
    for priority in sorted({sched[j].priority for j in queued}, reverse=True):
        level = [j for j in queued if sched[j].priority == priority and queued[j]]
        # A job's place in the turns: what it was given, over its weight. One that has been
        # given far more than the others (it ran alone a while) does not get a turn until they
        # caught up, but no further back than one turn behind the least served.
        least = min(given.get(j, 0) / sched[j].weight for j in level)
        served = {j: max(given.get(j, 0) / sched[j].weight, least) for j in level}
        at = {j: 0 for j in level}
        while level:
            job = min(level, key=lambda j: (served[j], j))
            order.append(queued[job][at[job]])
            at[job] += 1
            served[job] += 1 / sched[job].weight
            if at[job] >= len(queued[job]):
                level.remove(job)
    return order


def order_queue(conn: redis.Redis) -> bool:
    """Put RQ's queue in scheduling order; whether anything moved."""
    from genq.core.queueing import rq_queue

    queue = rq_queue(conn)
    ids = [i.decode() for i in conn.lrange(queue.key, 0, -1)]
    if len(ids) < 2:
        return False
    with conn.pipeline(transaction=False) as pipe:
        for rq_id in ids:
            pipe.hget(RQ_JOB_PREFIX + rq_id, "description")
        descriptions = pipe.execute()
    queued: dict[str, list[tuple[int, str]]] = {}
    for rq_id, description in zip(ids, descriptions):
        found = batch_of_description(description)
        if found is not None:
            queued.setdefault(found[0], []).append((_seq(found[1]), rq_id))
    if len(queued) < 2 and all(_in_order(v) for v in queued.values()):
        return False
    jobs = sorted(queued)
    sched = schedules(conn, jobs)
    counts = ledger_jobs.batches_counted(conn, jobs)
    given = {job: max(0, n - len(queued[job])) for job, n in zip(jobs, counts)}
    wanted = interleave({j: [i for _, i in sorted(queued[j])] for j in jobs}, given, sched)
    return bool(scripts.evaluate(conn, scripts.REORDER, scripts.reorder_call(queue.key, wanted)))


def head_of_queue(conn: redis.Redis) -> str | None:
    """The genq job of the queue's next batch, if any."""
    from genq.core.queueing import rq_queue

    found = batch_of_description(scripts.evaluate(conn, scripts.QUEUE_HEAD, scripts.queue_head_call(rq_queue(conn).key)))
    return found[0] if found else None


def _seq(batch: str) -> int:
    try:
        return int(batch[1:])
    except ValueError:
        return 0


def _in_order(items: list[tuple[int, str]]) -> bool:
    return all(a[0] <= b[0] for a, b in zip(items, items[1:]))
