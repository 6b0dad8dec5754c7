"""The RQ side of a worker: its RQ loops, and the job function they run for each batch.

A loop is a child process of the engine (`python -m genq.worker.rqjob`, started by
worker/loops.py): one stock `rq.SimpleWorker` that pops batch jobs off RQ's queue and runs
`run_batch` itself (a forked work horse per batch cost a fork, a start-up and RQ's horse
bookkeeping for a function that only waits, #29). RQ gives genq its transport: the job sits in
RQ's started registry, is heartbeated by the loop and shows in `rq info`. The prompts are driven
by the engine (one in-flight window per GPU): `run_batch` hands the batch over under a fresh
lease token and waits for the engine's word on that lease, "done" (the batch is complete, by
anyone) or "released" (the engine gave it back to the queue itself, or another lease of the
same batch took over), keeping RQ's heartbeats meanwhile (EngineWorker.keep_alive). It never
enqueues anything: a loop may be killed at any moment without losing a batch.

A loop dies with its engine (PR_SET_PDEATHSIG), so a killed engine never leaves loops taking
batches nobody will run, whatever state Redis is in. A loop that cannot reach Redis waits for
it, and if Redis goes away under RQ's own calls it exits with EXIT_REDIS_UNREACHABLE: the
engine starts another later, without counting it as a crash (worker/loops.py). A Redis that
refuses writes (full, its disk failing, a replica: genq.core.refusals) is treated the same. A Redis outage of any length stops
no worker.

RQ's registry maintenance is not run here: it marks a started job abandoned by comparing
scores other workers wrote with their own wall clocks against this machine's wall clock,
so one skewed clock would fail healthy batches everywhere. genq's ledger finds stranded
batches from Redis TTLs alone (genq.core.ledger).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from rq import SimpleWorker, get_current_job
from rq.exceptions import StopRequested
from rq.job import Job
from rq.serializers import JSONSerializer

from genq.core import keys
from genq.core.parentdeath import die_with_parent
from genq.core.records import pack
from genq.core.redisconn import ENV_VAR as REDIS_ENV
from genq.core.redisconn import connect
from genq.core.refusals import refusal, trouble
from genq.core.timings import ENGINE_GRACE_S, REPLY_POLL_S
from genq.worker.idle import POP_WAIT_S, QuietPops, unblock_own_pop
from genq.worker.models import LoopFilter

ENGINE_ENV = "GENQ_ENGINE"
EXIT_REDIS_UNREACHABLE = 75  # EX_TEMPFAIL: Redis went away under RQ (or refused writes); not a crash
REDIS_WAIT_MAX_S = 10.0


# Redis errors a loop waits out rather than fail a batch or count as a crash: Redis away or
# restarting, and (a ResponseError) a Redis that refuses writes for a while (genq.core.refusals).
_WAITED_OUT = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


def _waited_out(exc: BaseException) -> bool:
    return isinstance(exc, _WAITED_OUT) or refusal(exc) is not None


def _wait_for_redis(conn: redis.Redis) -> None:
    """Until Redis answers (restarting, loading a large dataset); this process dies with the engine."""
    delay = 0.5
    while True:
        try:
            conn.ping()
            return
        except (*_WAITED_OUT, redis.ResponseError) as exc:  # MISCONF refuses PING too
            if not _waited_out(exc):
                raise
            time.sleep(delay)
            delay = min(delay * 2, REDIS_WAIT_MAX_S)


class QuitWatch(logging.Filter):
    """RQ's loop logs an error of its own bookkeeping with its traceback, quits and tears down
    (rq/worker/base.py, work()); a Redis refusing writes at the moment a batch ends does that (its
    success pipeline refused). Kept here: the loop says it in one line and exits 75 as for an
    outage, or 1 for anything else, never 0, which would read as a queue found empty."""

    def __init__(self) -> None:
        super().__init__()
        self.exc: BaseException | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and "unhandled exception" in str(record.msg):
            self.exc = record.exc_info[1]
            return not _waited_out(self.exc)  # a refusal or an outage: said in one line by main()
        return True


class EngineWorker(QuietPops, SimpleWorker):
    """A stock RQ worker that takes no batch while its engine does not heartbeat (a frozen
    engine would only make each batch it takes fail and go round again), and that a stop
    never interrupts between taking a batch and starting it.

    RQ's stop handler raises at once in a worker that is not busy. Landing after the pop
    moved a batch into RQ's intermediate list, and before the job started, it left the batch
    there, out of the queue, until a reconciler pass (seen: a worker told to stop as one of
    its loops went back for its next batch). So a stop that comes while popping is kept,
    and acted on after a pop that took nothing (RQ raises StopRequested: nothing is held)
    or once the job has started (RQ then lets it run, and the engine hands the batch back).
    """

    engine: str = ""
    models: LoopFilter | None = None  # set in main(): other models' batches go back (worker/models.py)
    _popping = False
    _kept_stop: int | None = None  # the signal of a stop that came while popping

    _kept_alive_at = 0.0  # monotonic time of the last keep_alive beat

    def get_heartbeat_ttl(self, job: Job) -> int:
        """A forked worker's rule, not SimpleWorker's (which would give a batch that never times
        out 420 s): the batch's RQ heartbeat lapses job_monitoring_interval + 60 s after the last."""
        return self.job_monitoring_interval + 60

    def keep_alive(self, job: Job, now: bool = False) -> None:
        """RQ's heartbeat of this loop, the job and its execution, at most every
        job_monitoring_interval unless `now`; called by run_batch between its waits (a forked
        worker's parent did this for its horse). Redis away: beat again next time, do not die
        (run_batch waits for Redis too); Redis refusing writes raises (run_batch waits it out)."""
        if not now and time.monotonic() - self._kept_alive_at < self.job_monitoring_interval:
            return
        try:
            self.maintain_heartbeats(job)
            self._kept_alive_at = time.monotonic()
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            pass

    def run_maintenance_tasks(self) -> None:
        """Only the worker registry (below): genq uses neither RQ's scheduler nor its groups."""
        self.clean_registries()

    def clean_registries(self) -> None:
        """Not RQ's registry cleanup (wall clocks decide there: see the module docstring); only
        the worker registry, whose entries expire by Redis TTL, and by one loop of the fleet at a
        time (RQ's maintenance lock, left to expire: 15 minutes): it reads every loop's key."""
        from rq.utils import now
        from rq.worker_registration import clean_worker_registry

        for queue in self.queues:
            if queue.acquire_maintenance_lock():
                clean_worker_registry(queue)
        # RQ's own sets this: without it RQ's maintenance (this, and a look at its groups) ran
        # before every pop, 6 commands each (issue #29), rather than every maintenance_interval.
        self.last_cleaned_at = now()

    def check_for_suspension(self, burst: bool) -> None:
        super().check_for_suspension(burst)
        while not self._stop_requested and not self.connection.exists(keys.engine_alive(self.engine)):
            time.sleep(1.0)

    def request_stop(self, signum: int, frame: Any) -> None:
        if self._popping:
            self._kept_stop = signum
            unblock_own_pop(self.connection, self.name)  # the pop ends now, having taken nothing
            return
        super().request_stop(signum, frame)

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
        while True:
            self._popping = True
            try:
                # RQ's own wait loop, cut into waits of POP_WAIT_S so a kept stop is seen between them.
                result = super().dequeue_job_and_maintain_ttl(timeout, POP_WAIT_S if timeout else max_idle_time)
            except BaseException:
                self._popped()
                raise
            if result is not None and self.models and (rest := self.models.route(*result)) is not None:
                self._popped()  # nothing is held: a kept stop acts now
                time.sleep(rest)
                continue
            if result is not None:
                return result  # a batch: a stop is kept until prepare_execution marks this worker busy
            self._popped()
            if timeout is None:
                return None  # burst, and the queue is empty

    def prepare_execution(self, job: Job) -> Any:
        execution = super().prepare_execution(job)  # busy now: a stop lets the job run
        self._kept_alive_at = time.monotonic()  # RQ's first beat of the job is part of the above
        self._popped()
        return execution

    def _popped(self) -> None:
        """Act on a kept stop: RQ raises StopRequested if idle, or stops after the job if busy."""
        self._popping = False
        if self._kept_stop is not None:
            signum, self._kept_stop = self._kept_stop, None
            super().request_stop(signum, None)


# This process's loop, set in main(): run_batch runs inside it and keeps its RQ heartbeats.
_loop: EngineWorker | None = None


class EngineLost(RuntimeError):
    """The worker engine that took this batch is gone; the ledger's reconciler queues the batch again."""


def run_batch(job: str, batch_id: str) -> dict:
    rq_job = get_current_job()
    assert rq_job is not None, "run_batch runs inside an RQ worker"
    conn: redis.Redis = rq_job.connection
    if conn.sismember(keys.job_done(job), batch_id):
        return {"batch": batch_id, "status": "already done"}
    engine = os.environ.get(ENGINE_ENV)
    if not engine:
        raise EngineLost("this RQ worker was not started by `genq worker` (no GENQ_ENGINE set)")
    if not conn.exists(keys.engine_alive(engine)):
        raise EngineLost(f"worker engine {engine} is not heartbeating; not taking the batch")
    token = uuid.uuid4().hex
    conn.rpush(keys.engine_inbox(engine), pack([token, job, batch_id, rq_job.id]))
    reply = _wait_for_reply(conn, engine, keys.lease_reply(token), lambda now: _keep_alive(rq_job, now))
    conn.delete(keys.lease_reply(token))
    return {"batch": batch_id, "status": reply.decode()}


def _keep_alive(rq_job: Job, now: bool) -> None:
    if _loop is not None:  # None: run_batch called outside a loop of genq's
        _loop.keep_alive(rq_job, now)


def _wait_for_reply(conn: redis.Redis, engine: str, reply_key: str, keep_alive: Callable[[bool], None]) -> bytes:
    backoff = 0.5
    back_at = float("-inf")  # when Redis answered again after being unreachable
    while True:
        try:
            item = conn.blpop([reply_key], timeout=REPLY_POLL_S)
            if item is not None:
                return item[1]
            if not conn.exists(keys.engine_alive(engine)) and time.monotonic() - back_at > ENGINE_GRACE_S:
                # A write first: a Redis that refuses writes (full, its disk failing, a replica) lets
                # this read, yet the engine could not renew its key; that refusal is waited out below.
                keep_alive(True)
                raise EngineLost(f"worker engine {engine} stopped heartbeating while holding this batch")
            backoff = 0.5
            keep_alive(False)
        except (*_WAITED_OUT, redis.ResponseError) as exc:
            # Redis restarting, or full: keep the lease and wait; the engine keeps its results in memory.
            if not _waited_out(exc):
                raise
            time.sleep(backoff)
            backoff = min(backoff * 2, 10)
            back_at = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m genq.worker.rqjob")
    parser.add_argument("--name", required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--burst", action="store_true")
    parser.add_argument("--monitoring-interval", type=int, default=10)
    args = parser.parse_args(argv)
    die_with_parent(args.parent)
    for var in (ENGINE_ENV, REDIS_ENV):
        if not os.environ.get(var):
            parser.error(f"{var} must be set by the engine")
    # The URL comes through the environment: command lines are visible to every user (ps).
    conn = connect(os.environ[REDIS_ENV])
    # Every connection of this loop carries its name, from its (re)connect on: a stop finds the
    # one blocked in a pop by it (idle.unblock_own_pop), and no pop needs a CLIENT SETNAME.
    conn.connection_pool.connection_kwargs["client_name"] = args.name
    _wait_for_redis(conn)
    worker = EngineWorker(
        [keys.QUEUE],
        name=args.name,
        connection=conn,
        # A dead worker's batch is seen as abandoned after this + 60 s (RQ's rule).
        job_monitoring_interval=args.monitoring_interval,
        maintenance_interval=120,  # RQ's registry cleanup; genq's reconciler does its own (worker/maintenance.py)
        log_job_description=True,
        serializer=JSONSerializer,  # no pickle on genq's paths
    )
    worker.engine = os.environ[ENGINE_ENV]
    worker.models = LoopFilter(worker.connection, worker.engine)
    global _loop
    _loop = worker
    quit_watch = QuitWatch()
    worker.log.addFilter(quit_watch)
    try:
        worker.work(burst=args.burst, logging_level="WARNING")
    except StopRequested:  # a stop signal that landed during RQ's own teardown
        pass
    except (*_WAITED_OUT, redis.ResponseError) as exc:
        if not _waited_out(exc):
            raise
        return _waited_out_exit(args.name, exc)
    if quit_watch.exc is not None:  # RQ quit on an error and its teardown went through
        return _waited_out_exit(args.name, quit_watch.exc) if _waited_out(quit_watch.exc) else 1
    return 0


def _waited_out_exit(name: str, exc: BaseException) -> int:
    why = "" if refusal(exc) else f" ({exc})"  # a refusal quotes the refused command: said already
    print(f"RQ loop {name}: {trouble(exc)}{why}; the engine starts another", file=sys.stderr)
    return EXIT_REDIS_UNREACHABLE


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    # Run as the module RQ imports run_batch from, not as __main__ (a second copy of this one):
    # the loop that run_batch keeps alive must be the one it finds in _loop.
    from genq.worker import rqjob

    sys.exit(rqjob.main())
