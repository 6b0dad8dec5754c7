"""A job's ledger brought up to its output: what is written is done, whatever Redis says (docs/recovery.md).
A lost job is created again from OUTPUT/JOB/job.json; each written batch is adopted from its marker (ADOPT
marks it done as RELEASE would, counted as the marker says), never generated again."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec
import redis
import redis.asyncio as aioredis

from genq.core import scripts
from genq.core.ledger import jobs as ledger_jobs
from genq.core.queueing import batch_number, list_jobs, load_config, save_config
from genq.core.records import BatchRef, DeadLetter, JobConfig, JobRecord, Prompt, Result, ShardMarker
from genq.core.words import plural
from genq.ops.control import Refused, settings_from_output
from genq.output import truth
from genq.producer.rows import claim_digest

log = logging.getLogger("genq.recover")


def adopt(conn: redis.Redis, job: str, marker: ShardMarker) -> bool:
    """Mark a written batch done from its marker; True only if this call did. ADOPT answers 1, else 0 (done
    already) or b'gone' (another life of the job in Redis): true in Python, so never read as a truth value."""
    return scripts.evaluate(conn, scripts.ADOPT, scripts.adopt_call(job, marker, truth.shard_info(marker))) == 1


def written_marker(config: JobConfig, ref: BatchRef) -> ShardMarker | None:
    """The batch's marker in the output, if this life of the job wrote it."""
    store = truth.open_store(config.output, config.s3_endpoint_url)
    marker = truth.read_marker(store, truth.marker_rel(ref.job, ref.batch))
    return marker if marker is not None and marker.incarnation == config.incarnation else None


async def adopt_marker(conn: aioredis.Redis, ref: BatchRef, marker: ShardMarker) -> bool:  # False: not by this call
    call = scripts.adopt_call(ref.job, marker, truth.shard_info(marker))
    if adopted := await scripts.evaluate(conn, scripts.ADOPT, call) == 1:  # as adopt()
        log.warning("batch %s: its shard is in the output already (%d records, %s): marked done from its "
                    "marker, not generated again (Redis had lost it)", ref, marker.records, marker.uri)
    return adopted


async def adopt_if_written(conn: aioredis.Redis, config: JobConfig, ref: BatchRef) -> bool:
    """True (and the batch marked done: nothing is sent) if the output holds its shard for this life of the job."""
    try:
        marker = await asyncio.to_thread(written_marker, config, ref)
    except Exception as exc:  # the output unreachable now: the shard write checks again (truth.commit_shard)
        log.warning("batch %s: cannot look for its shard in %s (%s: %s)", ref, config.output, type(exc).__name__, exc)
        return False
    if marker is not None:
        await adopt_marker(conn, ref, marker)
    return marker is not None


def outcome_for(prompts: Iterable[Prompt], results: list[Result], letters: list[DeadLetter], size: int) -> ShardMarker:
    return truth.outcome_of(results, letters, {p.id: claim_digest(p) for p in prompts}, size)


def catch_up(conn: redis.Redis, config: JobConfig) -> list[str]:
    """The latest settings of Redis's and job.json's taken, and the batches of this life of the job that the
    output has and the ledger does not count as done adopted: those."""
    store = truth.open_store(config.output, config.s3_endpoint_url)
    on_disk = truth.read_job(store, config.name)
    settings_from_output(conn, config, on_disk)
    undone = truth.marker_batches(store, config.name) - ledger_jobs.done_batches(conn, config.name)
    markers = truth.of_life(truth.read_markers(store, config.name, undone), config)
    if adopted := [m.batch for m in markers if adopt(conn, config.name, m)]:
        log.warning("job %s: %s written to %s and not done in Redis (it lost recent writes); marked done from "
                    "their markers, not generated again: %s", config.name, plural(len(adopted), "batch", "batches"),
                    config.output, ", ".join(adopted[:8]) + (" ..." if len(adopted) > 8 else ""))
    return adopted


@dataclass
class Recovery:
    config: JobConfig
    record: JobRecord
    adopted: list[str]  # batches marked done from their markers
    rebuilt: bool  # the job was gone from Redis and was created again from job.json
    dropped_keys: int = 0  # keys of the job found in Redis without its config (orphans), removed


def recover(conn: redis.Redis, job: str, output: str | None = None, endpoint_url: str | None = None) -> Recovery:
    """Created again from OUTPUT/JOB/job.json when Redis has no config for the job, else caught up."""
    if (config := load_config(conn, job)) is not None:
        if output is not None and output.rstrip("/") != config.output.rstrip("/"):  # never read silently elsewhere
            raise Refused(f"job {job!r} is in Redis with output {config.output}, not {output}: leave --output out "
                          "(or give that one)")
        adopted = catch_up(conn, config)
        config = load_config(conn, job) or config  # with the output's settings, when Redis had lost them
        record = truth.read_job(truth.open_store(config.output, config.s3_endpoint_url), job)
        return Recovery(config=config, record=record or JobRecord(config=config), adopted=adopted, rebuilt=False)
    if output is None:
        raise Refused(f"job {job!r} is not in Redis: give the output it wrote to (--output)")
    if (on_disk := truth.read_job(truth.open_store(output, endpoint_url), job)) is None:
        raise Refused(f"job {job!r} is not in Redis and {output}/{job}/job.json does not exist: "
                      "nothing to recover it from")
    return rebuild(conn, on_disk)


def rebuild(conn: redis.Redis, record: JobRecord) -> Recovery:
    """The job created again in Redis from its job.json, every marker of its life adopted."""
    config, job = record.config, record.config.name
    store = truth.open_store(config.output, config.s3_endpoint_url)
    markers = truth.of_life(truth.read_markers(store, job, truth.marker_batches(store, job)), config)
    # What Redis holds of the job without its config is not its ledger: results and claims written
    # into an empty Redis by workers that held batches when it was lost.
    orphans = ledger_jobs.find_job_keys(conn, job)
    top = max([record.reserved, *(batch_number(m.batch) for m in markers)], default=0)
    with conn.pipeline(transaction=True) as pipe:
        if orphans:
            pipe.delete(*orphans)
        save_config(pipe, config)
        if record.schedule is not None:
            ledger_jobs.stage_schedule(pipe, job, record.schedule)
        if record.paused:
            ledger_jobs.pause(pipe, job)
        ledger_jobs.stage_last_batch_number(pipe, job, top)
        pipe.execute()
    adopted = [m.batch for m in markers if adopt(conn, job, m)]
    if record.deleted_at is not None:  # `genq jobs delete` marked it; it is asked back: it lives again
        truth.mark_deleted(store, job, None)
        record = msgspec.structs.replace(record, deleted_at=None)
    log.warning("job %s was not in Redis: created again from %s (incarnation %s), %s adopted", job,
                truth.job_uri(store, job), config.incarnation, plural(len(adopted), "written batch", "written batches"))
    return Recovery(config=config, record=record, adopted=adopted, rebuilt=True, dropped_keys=len(orphans))


class OutputWatch:
    """A worker's look at its jobs' outputs at its start, after Redis restarted and once a minute: written
    batches adopted, lost enqueues queued again (`queue_lost`), a job gone from Redis named with its way back."""

    EVERY_S = 60.0

    def __init__(self, conn: redis.Redis, queue_lost: Callable[[redis.Redis, JobConfig], int]) -> None:
        self.conn, self.queue_lost = conn, queue_lost
        self._run_id: str | None = None
        self._last = float("-inf")  # a worker's start compares at once
        self._outputs: dict[str, str] = {}  # job -> its output, as last seen
        self._missing: set[str] = set()

    def pass_once(self) -> None:
        try:
            run_id: str | None = str(self.conn.info("server").get("run_id"))
        except redis.ResponseError:  # INFO not allowed (renamed in some managed Redis): only the minute's pass
            run_id = self._run_id
        restarted = self._run_id is not None and run_id != self._run_id
        if not restarted and time.monotonic() - self._last < self.EVERY_S:
            return
        self._run_id, self._last = run_id, time.monotonic()
        jobs = list_jobs(self.conn)
        for job in jobs:
            if (config := load_config(self.conn, job)) is None:
                continue
            self._outputs[job] = config.output
            try:
                catch_up(self.conn, config)
                self.queue_lost(self.conn, config)
            except Exception as exc:  # the output unreachable (disk, S3): next time
                log.warning("job %s: cannot read its output %s to check the ledger against it: %s",
                            job, config.output, exc)
        for job in sorted(set(self._outputs) - set(jobs) - self._missing):
            self._missing.add(job)
            log.error("job %s is gone from Redis (restarted empty or flushed?) but its output %s remains: "
                      "`genq recover --job %s --output %s` rebuilds it from there (or enqueue the same input "
                      "again)", job, self._outputs[job], job, self._outputs[job])
        self._missing &= set(self._outputs) - set(jobs)
