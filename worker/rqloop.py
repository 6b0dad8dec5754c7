"""Child process: one stock RQ work loop (`rq.SimpleWorker`) for a genq engine.

Started by the engine with `python -m genq.worker.rqloop`; dies with it (PR_SET_PDEATHSIG),
so a killed engine never leaves loops taking batches nobody will run, whatever state Redis
is in. The loop runs each batch's job function itself (genq.worker.rqjob), which only hands
the batch to the engine and waits: a forked work horse per batch cost a fork, an interpreter's
worth of copy-on-write and RQ's horse bookkeeping for nothing (#29). While it waits, the job
function keeps RQ's heartbeats (EngineWorker.keep_alive), as a forked worker's parent would.

A loop that cannot reach Redis waits for it, and if Redis goes away under RQ's own calls it
exits with EXIT_REDIS_UNREACHABLE: the engine starts another later, without counting it as a
crash (worker/loops.py). A Redis outage of any length stops no worker.

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
from typing import Any

import redis
from rq import SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job
from rq.serializers import JSONSerializer

from genq.core import keys
from genq.core.parentdeath import die_with_parent
from genq.core.redisconn import ENV_VAR as REDIS_ENV
from genq.core.redisconn import connect
from genq.worker.idle import POP_WAIT_S, QuietPops, unblock_own_pop
from genq.worker.models import LoopFilter
from genq.worker.rqjob import ENGINE_ENV, keep_alive_with

EXIT_REDIS_UNREACHABLE = 75  # EX_TEMPFAIL: Redis went away under RQ; not a crash
REDIS_WAIT_MAX_S = 10.0


def _wait_for_redis(conn: redis.Redis) -> None:
    """Until Redis answers (restarting, loading a large dataset); this process dies with the engine."""
    delay = 0.5
    while True:
        try:
            conn.ping()
            return
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            time.sleep(delay)
            delay = min(delay * 2, REDIS_WAIT_MAX_S)


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

    _beaten_at = 0.0  # monotonic time of the last keep_alive beat

    def get_heartbeat_ttl(self, job: Job) -> int:
        """A forked worker's rule, not SimpleWorker's (which would give a batch that never times
        out 420 s): the batch's RQ heartbeat lapses job_monitoring_interval + 60 s after the last."""
        return self.job_monitoring_interval + 60

    def keep_alive(self, job: Job) -> None:
        """RQ's heartbeat of this loop, the job and its execution, at most every
        job_monitoring_interval; called by the job function between its waits (rqjob). Redis
        away: beat again next time, do not die (the job function waits for Redis too)."""
        if time.monotonic() - self._beaten_at < self.job_monitoring_interval:
            return
        try:
            self.maintain_heartbeats(job)
            self._beaten_at = time.monotonic()
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
        self._beaten_at = time.monotonic()  # RQ's first beat of the job is part of the above
        self._popped()
        return execution

    def _popped(self) -> None:
        """Act on a kept stop: RQ raises StopRequested if idle, or stops after the job if busy."""
        self._popping = False
        if self._kept_stop is not None:
            signum, self._kept_stop = self._kept_stop, None
            super().request_stop(signum, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m genq.worker.rqloop")
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
    keep_alive_with(worker.keep_alive)
    try:
        worker.work(burst=args.burst, logging_level="WARNING")
    except StopRequested:  # a stop signal that landed during RQ's own teardown
        pass
    except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
        print(f"RQ loop {args.name}: Redis unreachable ({exc}); the engine starts another", file=sys.stderr)
        return EXIT_REDIS_UNREACHABLE
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
