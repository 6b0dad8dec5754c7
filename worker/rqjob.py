"""The RQ job function: one call carries one batch to the local worker engine.

RQ gives genq its transport: the job sits in RQ's started registry, is heartbeated by the
RQ loop running it (genq.worker.rqloop, an `rq.SimpleWorker`: no process is forked per
batch) and shows in `rq info`. The prompts themselves are driven by the engine that
started the loop (one in-flight window per GPU). This function hands the batch over
under a fresh lease token and waits for the engine's word on that lease: "done" (the
batch is complete, by anyone) or "released" (the engine gave it back to the queue
itself, or another lease of the same batch took over). It never enqueues anything: the
loop may be killed at any moment without losing a batch.

The loop dies with its engine (PR_SET_PDEATHSIG), so no call outlives the worker that
took the batch, even while Redis is unreachable.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from rq import get_current_job

from genq.core import keys
from genq.core.records import pack
from genq.core.timings import ENGINE_GRACE_S, REPLY_POLL_S

ENGINE_ENV = "GENQ_ENGINE"

# Called between waits for the engine's word, with the RQ job: the loop keeps RQ's heartbeats of
# itself, the job and its execution (rqloop.EngineWorker.keep_alive); a forked horse had its
# parent do this. None outside an RQ loop of genq's (a test calling run_batch).
_keep_alive: Callable[[Any], None] | None = None


def keep_alive_with(beat: Callable[[Any], None]) -> None:
    global _keep_alive
    _keep_alive = beat


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
    reply = _wait_for_reply(conn, engine, keys.lease_reply(token), lambda: _keep_alive and _keep_alive(rq_job))
    conn.delete(keys.lease_reply(token))
    return {"batch": batch_id, "status": reply.decode()}


def _wait_for_reply(conn: redis.Redis, engine: str, reply_key: str, keep_alive: Callable[[], object]) -> bytes:
    backoff = 0.5
    back_at = float("-inf")  # when Redis answered again after being unreachable
    while True:
        try:
            item = conn.blpop([reply_key], timeout=REPLY_POLL_S)
            if item is not None:
                return item[1]
            if not conn.exists(keys.engine_alive(engine)) and time.monotonic() - back_at > ENGINE_GRACE_S:
                raise EngineLost(f"worker engine {engine} stopped heartbeating while holding this batch")
            backoff = 0.5
            keep_alive()
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            # Redis restarting: keep the lease and wait; the engine keeps its results in memory.
            time.sleep(backoff)
            backoff = min(backoff * 2, 10)
            back_at = time.monotonic()
