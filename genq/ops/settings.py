"""A job's generation settings fixed in place, and a blocked job's way back (docs/settings.md).

`genq jobs set JOB --max-tokens 1024 ...` stores a new settings version in the job's config
(JobConfig.settings_version, with the change in settings_history); workers apply it to every
prompt not yet sent within a second (worker/parking.py) and each Result records the version it
ran under. `genq resume --job JOB` lifts a block (keys.job_blocked, set by a worker's preflight
or brake) and queues the batches its workers parked.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import redis

from genq.core import keys
from genq.core.order import order_queue
from genq.core.queueing import carried, enqueue_batch_jobs, fetch_rq_jobs, list_jobs, rq_queue
from genq.core.records import JobBlock, JobConfig, Prompt, SettingsChange, pack, unpack

# The settings `genq jobs set` may change: what is sent with each request. Not endpoint (rows were
# fitted to it at enqueue), output, batch size or compression (written batches and shards follow them).
SETTABLE = ("model", "max_tokens", "temperature", "top_p", "extra_body", "max_attempts", "brake")


class SettingsError(ValueError):
    """The operator asked for something that cannot be done; the message says what and why."""


def set_settings(conn: redis.Redis, job: str, changes: dict[str, Any], note: str | None = None) -> JobConfig:
    """Store `changes` as the job's next settings version; returns the new config. A change that
    changes nothing is refused, so every version in the history differs from the one before."""
    unknown = sorted(set(changes) - set(SETTABLE))
    if unknown:
        raise SettingsError(f"cannot set {', '.join(unknown)}; settable: {', '.join(SETTABLE)}")
    key = keys.job_config(job)
    result: list[JobConfig] = []

    def change(pipe: redis.client.Pipeline) -> None:
        raw = pipe.get(key)
        if raw is None:
            raise SettingsError(f"no job named {job!r} (or it has no stored settings)")
        config = unpack(raw, JobConfig)
        differing = {k: v for k, v in changes.items() if getattr(config, k) != v}
        if not differing:
            raise SettingsError(f"job {job!r} has these settings already (version {config.settings_version})")
        version = config.settings_version + 1
        entry = SettingsChange(version=version, at=time.time(), changed=differing,
                               previous={k: getattr(config, k) for k in differing}, note=note)
        updated = msgspec.structs.replace(config, **differing, settings_version=version,
                                          settings_history=[*config.settings_history, entry])
        pipe.multi()
        pipe.set(key, pack(updated))
        result[:] = [updated]

    conn.transaction(change, key)
    return result[0]


def with_override(prompt: Prompt, override: dict[str, Any]) -> Prompt:
    """The prompt with `override` over its own sampling (`genq dlq requeue --max-tokens N`: a row's
    sampling wins over the job's settings in every request)."""
    if not override:
        return prompt
    return msgspec.structs.replace(prompt, sampling={**(prompt.sampling or {}), **override})


def block_of(conn: redis.Redis, job: str) -> JobBlock | None:
    raw = conn.get(keys.job_blocked(job))
    return unpack(raw, JobBlock) if raw else None


def blocks_of(conn: redis.Redis, jobs: list[str]) -> dict[str, JobBlock]:
    if not jobs:
        return {}
    raws = conn.mget([keys.job_blocked(j) for j in jobs])
    return {job: unpack(raw, JobBlock) for job, raw in zip(jobs, raws) if raw}


def unblock(conn: redis.Redis, job: str) -> int:
    """Lift the job's block and pause, and queue its parked batches again; how many were queued."""
    conn.delete(keys.job_blocked(job), keys.job_paused(job))
    queued = requeue_parked(conn, job)
    if queued:
        order_queue(conn)  # queued at the front: in priority order again (genq.core.order)
    return queued


def blocked_jobs(conn: redis.Redis) -> list[str]:
    jobs = list_jobs(conn)
    return sorted(blocks_of(conn, jobs))


def unqueue(conn: redis.Redis, job: str) -> int:
    """Take the blocked job's batches out of RQ's queue (they are parked like the held ones: no RQ
    job carries them, `genq resume --job` queues them again), so that workers do not take them one
    by one only to park them, and other jobs' batches behind them are not kept waiting. How many."""
    queue = rq_queue(conn)
    ids = queue.get_job_ids()
    mine = [(j.id, c[1]) for j in fetch_rq_jobs(conn, ids) if j is not None and (c := carried(j)) and c[0] == job]
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
        for rq_job in fetch_rq_jobs(conn, [rq_id for rq_id, _ in gone]):
            if rq_job is not None:
                rq_job.delete(pipeline=pipe, remove_from_queue=False)
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


def describe_block(job: str, block: JobBlock) -> str:
    """One paragraph for `genq jobs`, `genq jobs show` and the monitor."""
    if block.reason == "preflight":
        why = f"preflight by {block.worker}"  # its message names the settings version
    else:
        why = (f"brake on {block.worker}: {block.failures} of its last {block.outcomes} requests failed the same "
               f"way across {block.prompts} prompts (settings version {block.settings_version}"
               f"{f', HTTP {block.status}' if block.status else ''})")
    return (f"job {job} is blocked ({why}): {block.message} -- its prompts stay queued; fix the settings "
            f"(genq jobs set {job} ...), then genq resume --job {job}")
