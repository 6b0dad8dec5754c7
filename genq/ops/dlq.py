"""The dead-letter queue: prompts genq gave up on (DeadLetters) and batches RQ gave up on (id "batch:<batch id>").
Requeue and purge are MULTI under WATCH: a letter moves whole, and only once its batch can never run again
(a batch leased again regenerates every prompt with neither result nor letter: moved earlier, it runs twice)."""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import msgspec
import redis

from genq.core import queueing as q
from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger import letters
from genq.core.records import DeadLetter, EnqueueRecord, ErrorKind, JobConfig, JobRecord, batch_number
from genq.ops.control import Refused, jobs_named
from genq.output import truth
from genq.producer.rows import check_params

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


class Report(msgspec.Struct):  # what a requeue or a purge did
    prompts: dict[str, int] = {}  # job -> prompts requeued or letters purged
    new_batches: dict[str, list[str]] = {}  # job -> the requeued prompts' new batches
    batches: list[tuple[str, str, int]] = []  # failed batches moved: (job, batch, prompts requeued or forgotten)
    left: list[tuple[str, str]] = []  # (entry id, why)


def dead_letters(conn: redis.Redis, job: str) -> list[Entry]:
    return letters.read_all(conn, job, Entry)


def failed_batches(conn: redis.Redis, jobs: Collection[str], *, traceback: bool = False) -> list[Entry]:
    found = []
    for rq_job in q.fetch_rq_jobs(conn, q.failed_registry(conn).get_job_ids()):
        if rq_job is None or (ref := q.carried(rq_job)) is None or ref[0] not in jobs:
            continue
        job, batch_id = ref
        result = rq_job.latest_result()
        exc = (result.exc_string if result is not None else None) or ""
        last = next((line.strip() for line in reversed(exc.splitlines()) if line.strip()), "")
        batch = q.load_batch(conn, job, batch_id)
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
    for entry in found + (failed_batches(conn, jobs, traceback=traceback) if len(prompt_ids) < len(matches) else []):
        matches.get(entry.id, []).append(entry)
    if missing := [i for i, found in matches.items() if not found]:
        raise Refused(f"no dead letter or failed batch with id {', '.join(map(repr, missing))} in "
                      f"{f'job {job!r}' if job else 'any job'} (see `genq dlq list`; failed batches are named "
                      "batch:<batch id>)")
    if several := next((found for found in matches.values() if len(found) > 1), None):
        raise Refused(f"id {several[0].id!r} is in several jobs ({', '.join(e.job for e in several)}): add --job")
    return [found[0] for found in matches.values()]


def _movable(pipe: Any, job: str, ids: list[str], verb: str) -> tuple[list[DeadLetter], list[tuple[str, str]]]:
    """Letters (still in the DLQ) whose batch can never run again, and why the others are not."""
    found = [letter for letter in letters.read_some(pipe, job, ids, DeadLetter) if letter is not None]
    present = {letter.id for letter in found}
    left = [(i, "no longer in the dead-letter queue (requeued or purged meanwhile)") for i in ids if i not in present]
    live = {b for b in {letter.batch for letter in found} if ledger_jobs.batch_exists(pipe, job, b)}
    movable = []
    for letter in found:
        if letter.batch in live:
            left.append((letter.id, f"its batch {letter.batch} has not finished (still held by a worker, queued, "
                                    f"or failed in RQ); {verb} it once that batch completes"))
        elif verb == "requeue" and letter.prompt is None:
            left.append((letter.id, "the letter does not carry its prompt; re-enqueue it from the input"))
        else:
            movable.append(letter)
    return movable, left


Moved = tuple[list[str], list[tuple[str, str]], list[str]]  # letters moved, (id, why) left, new batches


def _each(conn: redis.Redis, chosen: Sequence[Entry], move: Callable[[str, list[str]], Callable[[Any], Moved]], *,
          requeue: bool) -> Report:
    """Each failed batch first (a purged batch's own letters can then be purged in the same run), then the dead
    prompts, CHUNK at a time, each chunk in one transaction: move(job, ids)(pipe)."""
    report, by_job = Report(), dict[str, list[str]]()
    for entry in chosen:
        if entry.is_batch:
            _move_batch(conn, entry, report, requeue=requeue)
        else:
            by_job.setdefault(entry.job, []).append(entry.id)
    for job, ids in by_job.items():
        for start in range(0, len(ids), CHUNK):
            moved, left, batch_ids = letters.transaction(conn, job, move(job, ids[start:start + CHUNK]))
            report.left.extend(left)
            if moved:
                report.prompts[job] = report.prompts.get(job, 0) + len(moved)
            if batch_ids:
                report.new_batches.setdefault(job, []).extend(batch_ids)
    return report


def requeue(conn: redis.Redis, chosen: Sequence[Entry], override: dict[str, Any] | None = None) -> Report:
    """Dead prompts back as new batches (`override` into each prompt's own sampling), failed batches queued again."""
    def some(job: str, ids: list[str]) -> Callable[[Any], Moved]:
        if (config := q.load_config(conn, job)) is None:
            raise Refused(f"job {job!r} has no stored config; cannot size its new batches")
        run = f"requeue-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"
        store = truth.open_store(config.output, config.s3_endpoint_url)
        # Numbered above what the output may hold (gaps are harmless), reserved in job.json before they are queued;
        # read once, not in each run of `move` under WATCH: numbers only grow, and truth.reserve merges.
        floor, on_disk = _numbers_in_use(store, config)

        def move(pipe: Any) -> Moved:
            found, left = _movable(pipe, job, ids, "requeue")
            # A fresh Prompt carries no attempt count: the engine starts it at 0.
            prompts = sorted((msgspec.structs.replace(d.prompt, sampling=_overridden(d.prompt.sampling, override))
                              if override else d.prompt for d in found if d.prompt is not None),
                             key=lambda p: (p.index, p.id))
            batches = q.new_batches(conn, job, prompts, config.batch_size, floor)
            # OUTPUT/JOB/enqueues/RUN.json names them before they are queued: a Redis that loses them requeues again.
            record = EnqueueRecord(incarnation=config.incarnation, input="", prompts=len(found),
                                   batches=truth.batch_ranges(b.id for b in batches), letters=[d.id for d in found],
                                   override=override or {})
            try:
                if found and on_disk is not None and (upto := batch_number(batches[-1].id)) > on_disk.reserved:
                    truth.reserve(store, on_disk, upto + truth.RESERVE_STEP)
                if found:
                    truth.write_enqueue(store, job, run, record)
            except Exception as exc:  # OSError, botocore's errors: the output unreachable costs only that
                log.warning("job %s: cannot record the requeue in its output %s (%s): a Redis restored from "
                            "before it would not requeue these letters again", job, config.output, exc)
            pipe.multi()
            if found:
                q.write_batches(pipe, conn, batches, digests={}, count_total=False)
                letters.stage_drop(pipe, job, found)
            return [d.id for d in found], left, [b.id for b in batches]

        return move

    check_override(conn, {e.job for e in chosen}, override)  # as at enqueue, before anything moves
    return _each(conn, chosen, some, requeue=True)


def check_override(conn: redis.Redis, jobs: Collection[str], override: dict[str, Any] | None) -> None:
    """RowError where the override does not fit a job's endpoint."""
    for job in jobs if override else ():
        if (config := q.load_config(conn, job)) is not None:
            check_params(override, "--extra-body", config.endpoint)


def _overridden(sampling: dict[str, Any] | None, override: dict[str, Any]) -> dict[str, Any]:
    """A prompt's request fields under requeue's: --max-tokens caps the row's max_completion_tokens too,
    which the servers would otherwise take over it."""
    if "max_tokens" in override:
        sampling = {k: v for k, v in (sampling or {}).items() if k != "max_completion_tokens"}
    return {**(sampling or {}), **override}


def _numbers_in_use(store: truth.Store, config: JobConfig) -> tuple[int, JobRecord | None]:
    """The highest batch number the job's output folder may hold (job.json's reserve, its markers), and its
    job.json if of this life; (0, None) where the output cannot be read (Redis's counter alone then)."""
    try:
        on_disk = truth.read_job(store, config.name)
        markers = truth.marker_batches(store, config.name)
    except Exception as exc:  # OSError, botocore's errors: the output unreachable
        log.warning("job %s: cannot read its output %s (%s): requeued batches numbered by Redis alone",
                    config.name, config.output, exc)
        return 0, None
    record = on_disk if on_disk is not None and on_disk.config.incarnation == config.incarnation else None
    return max([on_disk.reserved if on_disk else 0, *map(q.batch_number, markers)]), record


def purge(conn: redis.Redis, chosen: Sequence[Entry]) -> Report:
    """Dead prompts and failed batches out of every count (the DLQ, the job's total and id index: the same row
    enqueued again is queued anew; stats count them "purged")."""
    def forget(job: str, ids: list[str], pipe: Any) -> Moved:
        found, left = _movable(pipe, job, ids, "purge")
        pipe.multi()
        letters.stage_drop(pipe, job, found)
        letters.stage_forget_prompts(pipe, job, gone := [d.id for d in found])
        return gone, left, []

    return _each(conn, chosen, lambda job, ids: functools.partial(forget, job, ids), requeue=False)


def _move_batch(conn: redis.Redis, entry: Entry, report: Report, *, requeue: bool) -> None:
    """A failed batch queued again as a fresh RQ job (RQ's own requeue can leave it in no registry), or
    forgotten; its failed RQ job deleted in the same MULTI."""
    registry = q.failed_registry(conn)
    job, batch_id = entry.job, entry.batch

    def move(pipe: Any) -> str | int:
        if pipe.zscore(registry.key, entry.rq_job) is None:
            return GONE
        if not requeue and (finished := ledger_jobs.result_count(pipe, job, batch_id)):
            # Counted as done but in no shard yet: purging would lose finished work. Requeue finishes it.
            return (f"{finished} of its prompts finished but are not in a shard yet; "
                    f"`genq dlq requeue --job {job} {entry.id}` completes it without regenerating them")
        batch = None if requeue else q.load_batch(pipe, job, batch_id)
        ids = batch.prompt_ids() if batch else []
        # Its dead letters stay letters (purged with the others); the rest is forgotten.
        unfinished = [i for i, d in zip(ids, letters.read_some(pipe, job, ids, DeadLetter)) if d is None]
        old = q.fetch_rq_job(conn, str(entry.rq_job))
        pipe.multi()
        q.delete_rq_job(pipe, old)  # also out of the failed registry
        if requeue:
            q.enqueue_batch_jobs(pipe, conn, [(job, batch_id, entry.prompts or 0)])
            return entry.prompts or 0
        letters.stage_forget_batch(pipe, job, batch_id, had_record=batch is not None)
        letters.stage_forget_prompts(pipe, job, unfinished)
        return len(unfinished)

    outcome = letters.transaction(conn, job, move, batch=batch_id, also=[registry.key])
    if isinstance(outcome, str):
        return report.left.append((entry.id, outcome))
    report.batches.append((job, batch_id, outcome))
    if requeue or (config := q.load_config(conn, job)) is None:
        return
    # Out of the enqueue records that name it: gone on purpose, its prompts are not queued again (queue_lost).
    try:
        store = truth.open_store(config.output, config.s3_endpoint_url)
        for run, record in truth.read_enqueues(store, job).items():
            if batch_id in (named := truth.recorded_batches(record)):
                kept = truth.batch_ranges(b for b in named if b != batch_id)
                truth.write_enqueue(store, job, run, msgspec.structs.replace(record, batches=kept))
    except Exception as exc:  # OSError, botocore's errors
        log.warning("job %s: cannot take purged batch %s out of the enqueue records in %s (%s): a worker "
                    "would queue its prompts again", job, batch_id, config.output, exc)
