"""RQ's queue kept in scheduling order (docs/scheduling.md): highest priority first, then weighted turns
counting the batches each job was given already; REORDER only moves ids, never loses or adds one."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import redis

from genq.core import scripts
from genq.core.ledger import jobs as ledger_jobs
from genq.core.queueing import batch_of_description, rq_queue
from genq.core.records import JobSchedule, batch_number
from genq.core.scripts import RQ_JOB_PREFIX


def set_schedule(conn: redis.Redis, job: str, priority: int | None = None, weight: float | None = None,
                 keep: Callable[[JobSchedule], object] = lambda new: None) -> JobSchedule:
    """Store the job's priority and/or weight (the others kept; `keep` given the new one first, to write it
    durably) and put the queue in order again."""
    if weight is not None and not weight > 0:
        raise ValueError("a weight is > 0")
    given = {name: v for name, v in (("priority", priority), ("weight", weight)) if v is not None}

    def change(old: JobSchedule) -> JobSchedule:
        keep(new := msgspec.structs.replace(old, **given, changed_at=time.time(), version=old.version + 1))
        return new

    new = ledger_jobs.change_schedule(conn, job, change)
    order_queue(conn)
    return new


def interleave(queued: dict[str, list[str]], given: dict[str, int], sched: dict[str, JobSchedule]) -> list[str]:
    """Jobs' queued items in scheduling order (`given`: batches each job had out of the queue already)."""
    order: list[str] = []
    for priority in sorted({sched[j].priority for j in queued}, reverse=True):
        level = [j for j in queued if sched[j].priority == priority and queued[j]]
        # A job's place: what it was given over its weight, no further back than the least served.
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
        if found := batch_of_description(description):
            queued.setdefault(found[0], []).append((batch_number(found[1]), rq_id))
    if len(queued) < 2 and all(v == sorted(v, key=lambda e: e[0]) for v in queued.values()):  # in order already
        return False
    jobs = sorted(queued)
    counts = ledger_jobs.batches_counted(conn, jobs)
    given = {job: max(0, n - len(queued[job])) for job, n in zip(jobs, counts)}
    wanted = interleave({j: [i for _, i in sorted(queued[j])] for j in jobs}, given,
                        {j: now.schedule for j, now in zip(jobs, ledger_jobs.jobs_now(conn, jobs))})
    return bool(scripts.evaluate(conn, scripts.REORDER, scripts.reorder_call(queue.key, wanted)))
