"""The RQ job function: one call holds one batch for the local worker engine.

RQ gives genq durable leases: the job sits in RQ's started registry, is
heartbeated by the forked RQ worker, is retried when its worker dies, and shows
in `rq info`. The prompts themselves are driven by the engine process that
started this RQ worker (one shared in-flight window per GPU, so the next
batch fills slots while this one's long tail drains); this function hands the
batch over and waits for the engine's word.
"""

from __future__ import annotations

import os
import time

import redis
from rq import get_current_job

from genq.core import keys
from genq.core.queueing import enqueue_batch_jobs, load_batch
from genq.core.records import pack

ENGINE_ENV = "GENQ_ENGINE"
REPLY_POLL_S = 2


class EngineLost(RuntimeError):
    """The worker engine that took this batch is gone; RQ's retry hands it to another."""


def run_batch(job: str, batch_id: str) -> dict:
    rq_job = get_current_job()
    assert rq_job is not None, "run_batch runs inside an RQ worker"
    conn: redis.Redis = rq_job.connection
    if conn.sismember(keys.job_done(job), batch_id):
        return {"batch": batch_id, "status": "already done"}
    engine = os.environ.get(ENGINE_ENV)
    if not engine:
        raise EngineLost("this RQ worker was not started by `genq worker` (no GENQ_ENGINE set)")
    reply_key = keys.lease_reply(rq_job.id)
    conn.delete(reply_key)
    conn.rpush(keys.engine_inbox(engine), pack([rq_job.id, job, batch_id]))
    reply = _wait_for_reply(conn, engine, reply_key)
    if reply == b"handback":
        batch = load_batch(conn, job, batch_id)
        size = len(batch.prompts) if batch else 0
        with conn.pipeline(transaction=True) as pipe:
            enqueue_batch_jobs(pipe, conn, [(job, batch_id, size)], at_front=True)
            pipe.execute()
        return {"batch": batch_id, "status": "handed back"}
    return {"batch": batch_id, "status": reply.decode()}


def _wait_for_reply(conn: redis.Redis, engine: str, reply_key: str) -> bytes:
    backoff = 0.5
    while True:
        try:
            item = conn.blpop([reply_key], timeout=REPLY_POLL_S)
            if item is not None:
                return item[1]
            if not conn.exists(keys.engine_alive(engine)):
                raise EngineLost(f"worker engine {engine} stopped heartbeating while holding this batch")
            backoff = 0.5
        except redis.ConnectionError:
            # Redis restarting: keep the lease and wait; the engine keeps its results in memory.
            time.sleep(backoff)
            backoff = min(backoff * 2, 10)
