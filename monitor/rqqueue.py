"""RQ's queue `genq` as the monitor sees it: how many of its batches belong to each genq job.

The RQ job ids are random, so a job is read from each RQ job's description ("genq batch
JOB/BATCH (N prompts)", genq.core.queueing), which never changes. Reading the whole list at
every refresh would cost O(queued batches); a QueueMirror kept between refreshes instead
reads only the list's two ends, in one transaction: RQ puts jobs at either end (RPUSH, or
LPUSH for at_front) and takes them from the front (LMOVE), so the queue now is some ids
pushed at the front + the mirror's ids less those taken + ids appended. The ids at both ends
must match the mirror exactly; anything else (an id removed in the middle by LREM, a
window too short for what was appended) makes it read the whole list again. So its counts
are always those of a full read, and a refresh costs what changed, not the queue's length.
"""

from __future__ import annotations

from collections import Counter

import redis

from genq.core.queueing import job_in_description, rq_queue
from genq.core.refusals import refusal

QUEUE_SCAN_LIMIT = 100_000  # beyond this many queued batches, per-job counts come from the first ones
WINDOW = 64  # ids read at each end of the list per refresh (more when more were appended)


def _ends(conn: redis.Redis, key: str, want_tail: int) -> list:
    """The list's length and both its ends, in one MULTI: one moment of the list. A full Redis
    refuses every command inside MULTI, reads too; then without it (while it is full nothing is
    queued, and a plan that does not fit what it read falls back to a whole read)."""
    for transaction in (True, False):
        try:
            with conn.pipeline(transaction=transaction) as pipe:
                pipe.llen(key)
                pipe.lrange(key, 0, WINDOW - 1)
                pipe.lrange(key, -want_tail, -1)
                return pipe.execute()
        except redis.ResponseError as exc:
            if not (transaction and refusal(exc)):
                raise
    raise AssertionError("unreachable: the read without MULTI returns or raises")


class QueueMirror:
    def __init__(self) -> None:
        self._at: dict[int, str] = {}  # position -> RQ id (positions only grow at the back, shrink at the front)
        self._pos: dict[str, int] = {}  # RQ id -> position
        self._job: dict[str, str | None] = {}  # RQ id -> genq job (None: not a genq batch)
        self.head = 0
        self.tail = 0  # one past the last position
        self.by_job: Counter[str] = Counter()
        self.total = 0
        self.full_reads = 0  # how often the whole list was read (tests and the bench look)

    def __len__(self) -> int:
        return self.tail - self.head

    # ---------------------------------------------------------------- reading

    def refresh(self, conn: redis.Redis) -> None:
        key = rq_queue(conn).key
        want_tail = WINDOW
        for _ in range(3):
            n, head, tail = _ends(conn, key, want_tail)
            self.total = int(n)
            if n == 0:
                self._clear()
                return
            if n > QUEUE_SCAN_LIMIT or not len(self):
                break
            plan = self._plan(int(n), [i.decode() for i in head], [i.decode() for i in tail])
            if plan is None:
                break
            if isinstance(plan, int):  # more was appended than the tail window holds
                want_tail = plan
                continue
            self._apply(conn, *plan)
            return
        self._full(conn, key)

    def _plan(self, n: int, head: list[str], tail: list[str]) -> tuple[list[str], int, list[str]] | int | None:
        """(pushed at the front, taken from the front, appended), a wider tail window to read, or
        None when the list did not change only at its ends."""
        fronts = 0
        while fronts < len(head) and head[fronts] not in self._pos:
            fronts += 1
        if fronts == len(head):
            return None
        taken = self._pos[head[fronts]] - self.head
        kept = len(self) - taken
        rest = head[fronts:fronts + kept]
        if rest != [self._at[self.head + taken + j] for j in range(len(rest))]:
            return None
        appended = n - fronts - kept
        if appended < 0:
            return None
        if appended + 1 > len(tail):
            return appended + 1 + WINDOW if len(tail) < n else None
        if tail[-(appended + 1)] != self._at[self.tail - 1]:
            return None
        return head[:fronts], taken, tail[len(tail) - appended:] if appended else []

    def _apply(self, conn: redis.Redis, fronts: list[str], taken: int, appended: list[str]) -> None:
        for _ in range(taken):
            self._forget(self._at.pop(self.head))
            self.head += 1
        for rq_id in fronts[::-1]:  # head[0] was pushed last
            self.head -= 1
            self._remember(rq_id, self.head)
        for rq_id in appended:
            self._remember(rq_id, self.tail)
            self.tail += 1
        self._name(conn, fronts + appended)

    def _full(self, conn: redis.Redis, key: str) -> None:
        self.full_reads += 1
        ids = [i.decode() for i in conn.lrange(key, 0, QUEUE_SCAN_LIMIT - 1)]
        known = self._job
        self._clear()
        for n, rq_id in enumerate(ids):
            self._remember(rq_id, n)
        self.tail = len(ids)
        self._name(conn, [i for i in ids if i not in known], known)

    # ---------------------------------------------------------------- bookkeeping

    def _clear(self) -> None:
        self._at, self._pos, self._job = {}, {}, {}
        self.head = self.tail = 0
        self.by_job = Counter()

    def _remember(self, rq_id: str, pos: int) -> None:
        self._at[pos] = rq_id
        self._pos[rq_id] = pos

    def _forget(self, rq_id: str) -> None:
        del self._pos[rq_id]
        job = self._job.pop(rq_id, None)
        if job is not None:
            self.by_job[job] -= 1
            if not self.by_job[job]:
                del self.by_job[job]

    def _name(self, conn: redis.Redis, ids: list[str], known: dict[str, str | None] | None = None) -> None:
        """Each id's genq job: from `known` (an earlier read), else its RQ job's description."""
        if known:
            for rq_id in self._pos:
                if rq_id in known:
                    self._count(rq_id, known[rq_id])
        job_key = rq_queue(conn).job_class.key_for
        for start in range(0, len(ids), 5000):
            chunk = ids[start:start + 5000]
            with conn.pipeline(transaction=False) as pipe:
                for rq_id in chunk:
                    pipe.hget(job_key(rq_id), "description")
                for rq_id, raw in zip(chunk, pipe.execute()):
                    text = raw.decode(errors="replace") if raw else ""
                    self._count(rq_id, job_in_description(text))

    def _count(self, rq_id: str, job: str | None) -> None:
        self._job[rq_id] = job
        if job is not None:
            self.by_job[job] += 1
