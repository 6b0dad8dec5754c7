"""RQ's queue `genq` by genq job (each RQ id's description read once). A QueueMirror reads only the list's two
ends (RQ pushes at either end, takes from the front); anything else makes it read the whole list, so its counts
are always a full read's (docs/performance.md)."""

from __future__ import annotations

from collections import Counter, deque
from itertools import islice

import redis

from genq.core.queueing import batch_of_description, rq_queue
from genq.core.redisconn import refusal

QUEUE_SCAN_LIMIT = 100_000  # beyond this many queued batches, per-job counts come from the first ones
WINDOW = 64  # ids read at each end of the list per refresh (more when more were appended)


def _ends(conn: redis.Redis, key: str, want_tail: int) -> tuple[int, list[str], list[str]]:
    """The list's length and both its ends, in one MULTI; without it where a full Redis refuses MULTI."""
    for transaction in (True, False):
        try:
            with conn.pipeline(transaction=transaction) as pipe:
                pipe.llen(key)
                pipe.lrange(key, 0, WINDOW - 1)
                pipe.lrange(key, -want_tail, -1)
                n, head, tail = pipe.execute()
                return int(n), [i.decode() for i in head], [i.decode() for i in tail]
        except redis.ResponseError as exc:
            if not (transaction and refusal(exc)):
                raise
    raise AssertionError("unreachable: the read without MULTI returns or raises")


class QueueMirror:
    def __init__(self) -> None:
        self.ids: deque[str] = deque()  # the queue's RQ ids, front first
        self.job_of: dict[str, str | None] = {}  # RQ id -> genq job (None: not a genq batch)
        self.by_job: Counter[str] = Counter()
        self.total = 0
        self.full_reads = 0  # how often the whole list was read (tests and the bench look)

    def refresh(self, conn: redis.Redis) -> None:
        key = rq_queue(conn).key
        want_tail = WINDOW
        for _ in range(3):
            n, head, tail = _ends(conn, key, want_tail)
            self.total = n
            if not 0 < n <= QUEUE_SCAN_LIMIT or not self.ids:  # an empty queue's full read is of nothing
                break
            fronts = next((k for k, rq_id in enumerate(head) if rq_id in self.job_of), None)
            if fronts is None:
                break
            taken = self.ids.index(head[fronts])
            kept = len(self.ids) - taken
            rest = head[fronts:fronts + kept]
            appended = n - fronts - kept
            if rest != list(islice(self.ids, taken, taken + len(rest))) or appended < 0:
                break
            if appended + 1 > len(tail):  # more was appended than the tail window holds (never the whole list)
                want_tail = appended + 1 + WINDOW
                continue
            if tail[-(appended + 1)] != self.ids[-1]:
                break
            for _ in range(taken):
                if (job := self.job_of.pop(self.ids.popleft(), None)) is not None:
                    self.by_job -= Counter([job])  # a job's count at 0 is dropped
            added = head[:fronts] + tail[len(tail) - appended:]
            self.ids.extendleft(reversed(head[:fronts]))  # head[0] was pushed last
            self.ids.extend(added[fronts:])
            self._name(conn, added)
            return
        self._full(conn, key)

    def _full(self, conn: redis.Redis, key: str) -> None:
        self.full_reads += 1
        known = self.job_of
        self.ids = deque(i.decode() for i in conn.lrange(key, 0, QUEUE_SCAN_LIMIT - 1))
        self.job_of, self.by_job = {}, Counter()
        for rq_id in self.ids:
            if rq_id in known:
                self._count(rq_id, known[rq_id])
        self._name(conn, [i for i in self.ids if i not in known])

    def _name(self, conn: redis.Redis, ids: list[str]) -> None:
        job_key = rq_queue(conn).job_class.key_for
        for start in range(0, len(ids), 5000):
            chunk = ids[start:start + 5000]
            with conn.pipeline(transaction=False) as pipe:
                for rq_id in chunk:
                    pipe.hget(job_key(rq_id), "description")
                for rq_id, raw in zip(chunk, pipe.execute()):
                    found = batch_of_description(raw)
                    self._count(rq_id, found[0] if found else None)

    def _count(self, rq_id: str, job: str | None) -> None:
        self.job_of[rq_id] = job
        if job is not None:
            self.by_job[job] += 1
