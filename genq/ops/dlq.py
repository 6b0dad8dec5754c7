"""The dead-letter queue, one view of prompts genq gave up on (a DeadLetter in the job's DLQ) and
batches RQ gave up on (its failed registry, id "batch:<batch id>": the reconciler queues them again).

Requeue and purge are MULTI under WATCH: each letter moves whole or not at all, and only once its
batch can never run again (a batch leased again regenerates every prompt with neither a result
nor a letter, so moving the letter earlier would produce it twice).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import msgspec
import redis

from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger import letters
from genq.core.queueing import (
    carried,
    delete_rq_job,
    enqueue_batch_jobs,
    failed_registry,
    fetch_rq_job,
    fetch_rq_jobs,
    load_batch,
    load_config,
    new_batches,
    write_batches,
)
from genq.core.records import DeadLetter, EnqueueRecord, ErrorKind, JobConfig
from genq.ops import Refused, jobs_named
from genq.output import truth
from genq.output.truth import open_store

log = logging.getLogger("genq.dlq")

BATCH_PREFIX = "batch:"
BATCH_FAILED: ErrorKind = "batch_failed"
CHUNK = 2000  # letters per transaction: keeps one MULTI a sensible size
GONE = "no longer in RQ's failed registry (requeued or purged meanwhile)"


class Entry(DeadLetter, omit_defaults=True):
    """A dead prompt as stored, or a failed batch (kind batch_failed, with the fields below)."""

    rq_job: str | None = None  # RQ's job id
    prompts: int | None = None  # prompts in the batch
    traceback: str | None = None  # the last run's traceback

    @property
    def is_batch(self) -> bool:
        return self.kind == BATCH_FAILED


class RequeueReport(msgspec.Struct):
    prompts: dict[str, int] = {}  # job -> prompts requeued
    new_batches: dict[str, list[str]] = {}  # job -> ids of the batches the prompts went to
    batches: list[tuple[str, str, int]] = []  # failed batches requeued: (job, batch, prompts)
    skipped: list[tuple[str, str]] = []  # (entry id, why)


class PurgeReport(msgspec.Struct):
    letters: dict[str, int] = {}  # job -> dead letters removed
    batches: list[tuple[str, str, int]] = []  # failed batches removed: (job, batch, prompts forgotten)
    kept: list[tuple[str, str]] = []  # (entry id, why)


def dead_letters(conn: redis.Redis, job: str) -> list[Entry]:
    return letters.read_all(conn, job, Entry)


def failed_batches(conn: redis.Redis, jobs: Collection[str], *, traceback: bool = False) -> list[Entry]:
    """The given jobs' batches in RQ's failed registry."""
    found = []
    for rq_job in fetch_rq_jobs(conn, failed_registry(conn).get_job_ids()):
        if rq_job is None or (ref := carried(rq_job)) is None or ref[0] not in jobs:
            continue
        job, batch_id = ref
        result = rq_job.latest_result()
        exc = (result.exc_string if result is not None else None) or ""
        last = next((line.strip() for line in reversed(exc.splitlines()) if line.strip()), "")
        batch = load_batch(conn, job, batch_id)
        if batch is None and ledger_jobs.batch_done(conn, job, batch_id):
            last = f"batch already complete (RQ recorded a failure afterwards): {last}"  # RQ can, after the fact
        ended = rq_job.ended_at or (result.created_at if result is not None else None)
        found.append(Entry(
            id=BATCH_PREFIX + batch_id, job=job, batch=batch_id, attempts=1, kind=BATCH_FAILED,
            message=last or "(RQ stored no exception)", worker=rq_job.worker_name or "",
            at=ended.timestamp() if ended else 0.0, rq_job=rq_job.id, prompts=batch.count if batch else None,
            traceback=exc if traceback else None))
    return found


def entries(conn: redis.Redis, job: str | None, *, traceback: bool = False) -> list[Entry]:
    """Everything in the dead-letter view of one job or all, newest first."""
    jobs = jobs_named(conn, job)
    found = [e for j in jobs for e in dead_letters(conn, j)] + failed_batches(conn, jobs, traceback=traceback)
    return sorted(found, key=lambda e: (-e.at, e.job, e.id))


def find(conn: redis.Redis, ids: Sequence[str], job: str | None, *, traceback: bool = False) -> list[Entry]:
    """The entries with these ids; every id must name exactly one entry."""
    jobs = jobs_named(conn, job)
    matches: dict[str, list[Entry]] = {i: [] for i in ids}
    prompt_ids = [i for i in matches if not i.startswith(BATCH_PREFIX)]
    found = [e for j in jobs if prompt_ids for e in letters.read_some(conn, j, prompt_ids, Entry) if e is not None]
    if len(prompt_ids) < len(matches):
        found += failed_batches(conn, jobs, traceback=traceback)
    for entry in found:
        if entry.id in matches:
            matches[entry.id].append(entry)
    if missing := [i for i, found in matches.items() if not found]:
        raise Refused(f"no dead letter or failed batch with id {', '.join(map(repr, missing))} in "
                      f"{f'job {job!r}' if job else 'any job'} (see `genq dlq list`; failed batches are named "
                      "batch:<batch id>)")
    for i, found in matches.items():
        if len(found) > 1:
            raise Refused(f"id {i!r} is in several jobs ({', '.join(e.job for e in found)}): add --job")
    return [found[0] for found in matches.values()]


def _letter_chunks(chosen: Sequence[Entry]) -> Iterator[tuple[str, list[str]]]:
    """The dead prompts' ids, per job, CHUNK at a time."""
    by_job: dict[str, list[str]] = {}
    for entry in chosen:
        if not entry.is_batch:
            by_job.setdefault(entry.job, []).append(entry.id)
    for job, ids in by_job.items():
        for start in range(0, len(ids), CHUNK):
            yield job, ids[start:start + CHUNK]


def _movable(pipe: Any, job: str, ids: list[str], verb: str) -> tuple[list[DeadLetter], list[tuple[str, str]]]:
    """Letters (still in the DLQ) whose batch can never run again, and why the others are not."""
    found = [letter for letter in letters.read_some(pipe, job, ids, DeadLetter) if letter is not None]
    present = {letter.id for letter in found}
    skipped = [(i, "no longer in the dead-letter queue (requeued or purged meanwhile)") for i in ids if i not in present]
    live = {b for b in {letter.batch for letter in found} if ledger_jobs.batch_exists(pipe, job, b)}
    movable = []
    for letter in found:
        if letter.batch in live:
            skipped.append((letter.id, f"its batch {letter.batch} has not finished (still held by a worker, queued, "
                                       f"or failed in RQ); {verb} it once that batch completes"))
        elif verb == "requeue" and letter.prompt is None:
            skipped.append((letter.id, "the letter does not carry its prompt; re-enqueue it from the input"))
        else:
            movable.append(letter)
    return movable, skipped


def requeue(conn: redis.Redis, chosen: Sequence[Entry], override: dict[str, Any] | None = None) -> RequeueReport:
    """Dead prompts back as new batches (with the job's current settings; `override`, request
    fields, goes into each prompt's own sampling), failed batches back on the queue."""
    report = RequeueReport()
    for entry in chosen:
        if entry.is_batch:
            _requeue_batch(conn, entry, report)
    for job, ids in _letter_chunks(chosen):
        if (config := load_config(conn, job)) is None:
            raise Refused(f"job {job!r} has no stored config; cannot size its new batches")
        _requeue_letters(conn, config, ids, report, override or {})
    return report


def _requeue_letters(conn: redis.Redis, config: JobConfig, ids: list[str], report: RequeueReport,
                     override: dict[str, Any]) -> None:
    job, run = config.name, f"requeue-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"

    def move(pipe: Any) -> tuple[list[DeadLetter], list[tuple[str, str]], list[str]]:
        found, skipped = _movable(pipe, job, ids, "requeue")
        # A fresh Prompt carries no attempt count: the engine starts it at 0.
        # `override` goes over each prompt's own sampling, which wins over the job's settings.
        prompts = sorted((msgspec.structs.replace(letter.prompt, sampling={**(letter.prompt.sampling or {}), **override})
                          if override else letter.prompt for letter in found if letter.prompt is not None),
                         key=lambda p: (p.index, p.id))
        batches = new_batches(conn, job, prompts, config.batch_size)  # ids from INCRBY: gaps are harmless
        if found:
            _record_requeue(config, run, [b.id for b in batches], [letter.id for letter in found])
        pipe.multi()
        if found:
            write_batches(pipe, conn, batches, digests={}, count_total=False)
            letters.stage_drop(pipe, job, [letter.id for letter in found])
        return found, skipped, [b.id for b in batches]

    moved, skipped, batch_ids = letters.transaction(conn, job, move)
    report.skipped.extend(skipped)
    if moved:
        report.prompts[job] = report.prompts.get(job, 0) + len(moved)
        report.new_batches.setdefault(job, []).extend(batch_ids)


def _record_requeue(config: JobConfig, run: str, batches: list[str], ids: list[str]) -> None:
    """OUTPUT/JOB/enqueues/RUN.json names a requeue's batches and letters before they are queued, so
    a Redis that loses them requeues the letters again (genq.producer.enqueue.queue_lost)."""
    record = EnqueueRecord(incarnation=config.incarnation, input="", batches=truth.batch_ranges(batches),
                           prompts=len(ids), letters=ids)
    try:
        truth.write_enqueue(open_store(config.output, config.s3_endpoint_url), config.name, run, record)
    except Exception as exc:  # OSError, botocore's errors: the output unreachable costs only that
        log.warning("job %s: cannot record the requeue in its output %s (%s): a Redis restored from before "
                    "it would not requeue these letters again", config.name, config.output, exc)


def _requeue_batch(conn: redis.Redis, entry: Entry, report: RequeueReport) -> None:
    """A fresh RQ job for the batch and the failed one deleted, in one MULTI (not RQ's own requeue,
    whose separate steps can leave the batch in no registry): `rq info` tells the truth."""
    registry = failed_registry(conn)

    def move(pipe: Any) -> bool:
        if pipe.zscore(registry.key, entry.rq_job) is None:
            return False
        old = fetch_rq_job(conn, str(entry.rq_job))
        pipe.multi()
        enqueue_batch_jobs(pipe, conn, [(entry.job, entry.batch, entry.prompts or 0)])
        delete_rq_job(pipe, old)  # also out of the failed registry
        return True

    if conn.transaction(move, registry.key, value_from_callable=True):
        report.batches.append((entry.job, entry.batch, entry.prompts or 0))
    else:
        report.skipped.append((entry.id, GONE))


def purge(conn: redis.Redis, chosen: Sequence[Entry]) -> PurgeReport:
    """Forget dead prompts and failed batches: no retry, and out of every count (the DLQ, the job's
    total and id index, so the same row enqueued again is queued anew; stats count them "purged").
    Failed batches go first: their own dead letters can then be purged in the same run."""
    report = PurgeReport()
    for entry in chosen:
        if entry.is_batch:
            _purge_batch(conn, entry, report)
    for job, ids in _letter_chunks(chosen):
        _purge_letters(conn, job, ids, report)
    return report


def _purge_letters(conn: redis.Redis, job: str, ids: list[str], report: PurgeReport) -> None:
    def forget(pipe: Any) -> tuple[list[str], list[tuple[str, str]]]:
        found, kept = _movable(pipe, job, ids, "purge")
        gone = [letter.id for letter in found]
        pipe.multi()
        letters.stage_drop(pipe, job, gone)
        letters.stage_forget_prompts(pipe, job, gone)
        return gone, kept

    gone, kept = letters.transaction(conn, job, forget)
    report.kept.extend(kept)
    if gone:
        report.letters[job] = report.letters.get(job, 0) + len(gone)


def _purge_batch(conn: redis.Redis, entry: Entry, report: PurgeReport) -> None:
    registry = failed_registry(conn)
    job, batch_id = entry.job, entry.batch

    def forget(pipe: Any) -> str | list[str]:
        if pipe.zscore(registry.key, entry.rq_job) is None:
            return GONE
        if finished := ledger_jobs.result_count(pipe, job, batch_id):
            # Counted as done but in no shard yet: purging would lose finished work. Requeue finishes it.
            return (f"{finished} of its prompts finished but are not in a shard yet; "
                    f"`genq dlq requeue --job {job} {entry.id}` completes it without regenerating them")
        batch = load_batch(pipe, job, batch_id)
        ids = batch.prompt_ids() if batch else []
        # Its dead letters stay letters (purged with the others); the rest is forgotten.
        unfinished = [i for i, d in zip(ids, letters.read_some(pipe, job, ids, DeadLetter)) if d is None]
        old = fetch_rq_job(conn, str(entry.rq_job))
        pipe.multi()
        delete_rq_job(pipe, old)
        letters.stage_forget_batch(pipe, job, batch_id, had_record=batch is not None)
        letters.stage_forget_prompts(pipe, job, unfinished)
        return unfinished

    outcome = letters.transaction(conn, job, forget, batch=batch_id, also=[registry.key])
    if isinstance(outcome, str):
        report.kept.append((entry.id, outcome))
    else:
        report.batches.append((job, batch_id, len(outcome)))
        _unrecord_batch(conn, job, batch_id)


def _unrecord_batch(conn: redis.Redis, job: str, batch: str) -> None:
    """A purged batch leaves the enqueue records that name it: it is gone on purpose, not lost with
    Redis, and its forgotten prompts are not queued again (genq.producer.enqueue.queue_lost)."""
    if (config := load_config(conn, job)) is None:
        return
    try:
        store = open_store(config.output, config.s3_endpoint_url)
        for run, record in truth.read_enqueues(store, job).items():
            if batch in (named := truth.recorded_batches(record)):
                kept = truth.batch_ranges(b for b in named if b != batch)
                truth.write_enqueue(store, job, run, msgspec.structs.replace(record, batches=kept))
    except Exception as exc:  # OSError, botocore's errors
        log.warning("job %s: cannot take purged batch %s out of the enqueue records in %s (%s): a worker "
                    "would queue its prompts again", job, batch, config.output, exc)
