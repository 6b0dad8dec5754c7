"""Idempotent enqueue: checked rows in, batches and RQ jobs out.

Ids already queued (or done) for the job are skipped; an id seen before with other content is
rejected, never silently replaced. Ids are claimed in the transaction that writes their batches and
RQ jobs, under WATCH of the job's ids, batch counter and config: two enqueues of one input at once
queue each id once (the loser re-reads the ids and skips the winner's), and a crash never leaves ids
claimed without their batches. The job's config is written with its first batches, so an enqueue
that queues nothing creates nothing.

The output is the durable truth: before a batch is queued, OUTPUT/JOB/job.json reserves its number
and OUTPUT/JOB/enqueues/RUN.json names it (genq.output.truth), so what Redis loses is found there.

Memory is bounded whatever the input's size: rows are read a chunk at a time, the dedupe lives in
Redis, and only the rows of the group being queued are held. A dry run (`genq enqueue --dry-run`)
goes the same way writing nothing: its claims are held in memory instead.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import TypeVar

import msgspec
import redis

from genq.core.ledger import jobs as ledger_jobs
from genq.core.queueing import ID_NEW, ID_OTHER, ID_SAME, load_config, lookup_ids, stage_config, write_batches
from genq.core.records import (
    BatchSource,
    EnqueueRecord,
    InputRange,
    JobConfig,
    JobRecord,
    Rejected,
    batch_id,
    batch_number,
)
from genq.ops import dlq, recover
from genq.output import truth
from genq.output.truth import open_store
from genq.producer.batchinput import range_digest
from genq.producer.meter import Meter
from genq.producer.rejects import RejectsFile
from genq.producer.rows import Row
from genq.producer.sources import default_rejects_path, open_rows

log = logging.getLogger("genq.enqueue")

READ_CHUNK = 8192  # rows read before queueing what is ready
READ_AHEAD = 2  # chunks the reading thread may have ready: bounds the rows held
GROUP_BATCHES = 32  # batches per transaction: keeps a MULTI a sensible size (and the rows held)

T = TypeVar("T")


class JobConflict(ValueError):
    """Another enqueue created the job meanwhile with other settings."""


class JobClosed(ValueError):
    """New prompts for a finished job whose enqueue did not say to add them (the message says how)."""


@dataclass
class EnqueueSummary:
    read: int = 0  # valid rows
    enqueued: int = 0
    batches: int = 0
    converted: int = 0  # 'prompt' rows sent as one user message (chat endpoint)
    skipped_existing: int = 0  # already queued or done in an earlier run
    # Same id, same content, twice in this input close together (farther apart the second counts in
    # skipped_existing: the dedupe is Redis's, not this process's).
    skipped_duplicate: int = 0
    rejected: int = 0  # lines written to the rejects file
    created: bool = False  # this run created the job
    recovered_batches: int = 0  # batches written in the output that Redis did not count as done
    rebuilt: bool = False  # the job was gone from Redis and was created again from OUTPUT/JOB/job.json
    note: str = ""  # something about the output the operator should know


class Enqueuer:
    def __init__(self, conn: redis.Redis, config: JobConfig, *, create: bool, rejects: RejectsFile,
                 reference: str | None = None, input_uri: str | None = None, closed: str | None = None,
                 dry_run: bool = False) -> None:
        """create: the job has no stored config yet (it is stored with the first batches).
        rejects: where rejected lines go as they are found (the caller closes or discards it).
        reference: the input as workers read it (s3://... or an absolute path), to queue batches by
        reference; None stores the prompts inline. input_uri: recorded in job.json for `genq recover`.
        closed: the job is finished: JobClosed(closed) is raised before a new prompt is queued.
        dry_run: check and count as for real, writing nothing (neither Redis nor the output is written,
        nor the output read: prompts are counted against Redis alone)."""
        self.conn = conn
        self.rejects = rejects
        self.config = config
        self.reference = reference
        self.summary = EnqueueSummary()
        self._create = create
        self._closed = closed
        self._pending: list[Row] = []
        self._store = open_store(config.output, config.s3_endpoint_url)
        self._inputs = [input_uri] if input_uri else []
        self._record = JobRecord(config=config, inputs=self._inputs)
        self._floor = 0  # batch numbers at or below it may be in use in the output folder
        self._run = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"  # enqueues/RUN.json
        self._queued: list[str] = []
        self._prompts = 0
        self._dry_claims: dict[str, bytes] | None = {} if dry_run else None  # id -> digest, claimed in memory

    def run(self, rows: Iterable[Row | Rejected], on_progress: Callable[[EnqueueSummary], None] | None = None,
            meter: Meter | None = None) -> EnqueueSummary:
        """Queue `rows`. They are read (parsed, checked, digested) in a thread of their own, a chunk ahead
        of the one being queued, so Redis's replies and zstd (which release the GIL) overlap the parsing.
        `meter` (the one `rows` advance) is told how many rows are handed on."""
        if self._dry_claims is None:
            self._reach_output(self._from_output)
        meter, read = meter or Meter(), 0
        for items, position in _read_ahead(_chunks(rows, meter)):
            read += len(items)
            meter.read_upto(read, position)
            for item in items:
                if isinstance(item, Rejected):
                    self._reject(item)
                    continue
                if self.reference is not None and item.start < 0:
                    raise ValueError("by-reference batches need an uncompressed JSONL input")
                self._pending.append(item)
                self.summary.read += 1
                self.summary.converted += item.converted
            self._flush(final=False)
            meter.settle(read - len(self._pending))
            # Every reject still to come is of a pending row or a later line.
            self.rejects.release(self._pending[0].prompt.index + 1 if self._pending else None)
            if on_progress:
                on_progress(self.summary)
        self._flush(final=True)
        self.rejects.release(None)
        meter.finish()
        if on_progress:  # the rows of the last, short batch are queued too: 100%
            on_progress(self.summary)
        return self.summary

    def _from_output(self) -> None:
        """Batches written in the output that Redis does not count as done are adopted first, and a
        job gone from Redis whose job.json has the same settings is created again from there, so its
        written prompts count as done."""
        on_disk = truth.read_job(self._store, self.config.name)
        if not self._create:
            self.summary.recovered_batches = len(recover.catch_up(self.conn, self.config))
            if on_disk and on_disk.config.incarnation == self.config.incarnation:
                self._record = on_disk
        elif on_disk is not None and revives(on_disk, self.config):
            recovery = recover.rebuild(self.conn, on_disk)
            self.config, self._record, self._create = recovery.config, on_disk, False
            self.summary.recovered_batches, self.summary.rebuilt = len(recovery.adopted), True
        elif on_disk is not None:
            why = "was deleted (genq jobs delete)" if on_disk.deleted_at is not None else "had other settings"
            self.summary.note = (f"{truth.job_uri(self._store, self.config.name)} is of an earlier job of this name, "
                                 f"which {why}: this is a new job; the old one's shards stay and are not counted as "
                                 f"done for this one (genq recover --job {self.config.name} --output "
                                 f"{self.config.output} would have brought the old one back instead)")
            self._floor = on_disk.reserved
        written = truth.marker_batches(self._store, self.config.name)  # an output of a genq without job.json
        self._floor = max([self._floor, self._record.reserved, *map(batch_number, written)])
        self._record = msgspec.structs.replace(self._record, config=self.config)

    def _reach_output(self, action: Callable[[], T]) -> T:
        """Enqueue reads and writes the job's output: where it cannot, nothing is queued, with the reason."""
        try:
            return action()
        except redis.RedisError:
            raise
        except Exception as exc:  # OSError, botocore's errors: the output is unreachable from here
            raise ValueError(f"cannot read or write the job's output {self.config.output} from here "
                             f"({type(exc).__name__}: {exc}); enqueue writes {self.config.name}/job.json there "
                             "before queueing: give an --output this machine reaches too") from None

    def _reject(self, rejected: Rejected) -> None:
        self.summary.rejected += 1
        self.rejects.add(rejected)

    def _flush(self, final: bool) -> None:
        size = self.config.batch_size
        while self._pending and (final or len(self._pending) >= size):
            take = min(len(self._pending), GROUP_BATCHES * size)
            if not final:
                take -= take % size
            group, rest = self._pending[:take], self._pending[take:]
            # Rows checked but not queued (too few for a full batch) are checked again next time.
            self._pending = self._commit(group, final) + rest
            if not final and len(self._pending) == len(group) + len(rest):
                return  # nothing could be taken: wait for more rows

    def _commit(self, group: list[Row], final: bool) -> list[Row]:
        """Claim the new ids of `group` and queue their batches in one transaction; return the rows held back."""
        group = self._unique(group)
        size = self.config.batch_size
        with self.conn.pipeline(transaction=True) as pipe:
            while True:
                try:
                    known = self._lookup(pipe, group)
                    fresh = [row for row, k in zip(group, known) if k == ID_NEW]
                    keep = len(fresh) if final else len(fresh) - len(fresh) % size
                    taking, held = fresh[:keep], fresh[keep:]
                    if taking and self._closed is not None and not self._create:
                        pipe.reset()
                        raise JobClosed(self._closed)
                    batches = self._queue(pipe, taking) if taking else 0  # leaving the pipeline unwatches
                    break
                except redis.WatchError:
                    continue  # another enqueue (or a DLQ requeue) wrote meanwhile: look again
        self._prompts += len(taking)
        if batches and self._create:
            self._create = False
            self.summary.created = True
        self.summary.enqueued += len(taking)
        self.summary.batches += batches
        self.summary.skipped_existing += known.count(ID_SAME)
        for row, k in zip(group, known):
            if k == ID_OTHER:
                self._reject(_conflict(row, "queued earlier: farther up this input or in an earlier enqueue of this job"))
        return held

    def _lookup(self, pipe: redis.client.Pipeline, group: list[Row]) -> str:
        """ID_NEW, ID_SAME or ID_OTHER for each row, under WATCH of what the transaction depends on."""
        digests = [(row.prompt.id, row.digest) for row in group]
        if self._dry_claims is None:
            ledger_jobs.watch_enqueue(pipe, self.config.name)
            if self._create:
                self._check_created_meanwhile(pipe)
            return lookup_ids(pipe, self.config.name, digests)
        answers = list(lookup_ids(self.conn, self.config.name, digests))
        for i, (id_, digest) in enumerate(digests):
            if (claim := self._dry_claims.get(id_)) is not None:
                answers[i] = ID_SAME if claim == digest else ID_OTHER
        return "".join(answers)

    def _queue(self, pipe: redis.client.Pipeline, rows: list[Row]) -> int:
        """Claim the rows' ids and queue their batches (under WATCH, from `_lookup`); how many batches."""
        if self._dry_claims is not None:
            self._dry_claims.update((row.prompt.id, row.digest) for row in rows)
            return -(-len(rows) // self.config.batch_size)
        batches = self._batches(pipe, rows)
        self._reserve(batches[-1].id)
        self._record_enqueue([b.id for b in batches], len(rows))
        pipe.multi()
        if self._create:
            stage_config(pipe, self.config)
        ledger_jobs.stage_last_batch_number(pipe, self.config.name, batch_number(batches[-1].id))
        write_batches(pipe, self.conn, batches, {row.prompt.id: row.digest for row in rows})
        pipe.execute()
        self._queued += [b.id for b in batches]
        return len(batches)

    def _reserve(self, last_batch: str) -> None:
        """job.json says the batch numbers about to be queued may be in use, before they are."""
        upto = batch_number(last_batch)
        if upto > self._record.reserved or not set(self._inputs) <= set(self._record.inputs):
            record = msgspec.structs.replace(self._record, config=self.config,
                                             inputs=sorted(set(self._record.inputs) | set(self._inputs)))
            self._record = self._reach_output(lambda: truth.reserve(self._store, record, upto + truth.RESERVE_STEP))

    def _record_enqueue(self, batches: list[str], prompts: int) -> None:
        """OUTPUT/JOB/enqueues/RUN.json names these batches before they are queued: what Redis loses of
        them afterwards is found there (queue_lost)."""
        record = EnqueueRecord(incarnation=self.config.incarnation, input=self._inputs[0] if self._inputs else "",
                               batches=truth.batch_ranges(self._queued + batches), prompts=self._prompts + prompts)
        self._reach_output(lambda: truth.write_enqueue(self._store, self.config.name, self._run, record))

    def _check_created_meanwhile(self, pipe: redis.client.Pipeline) -> None:
        stored = load_config(pipe, self.config.name)
        if stored is None:
            return
        if _settings(stored) != _settings(self.config):
            raise JobConflict(f"job {self.config.name!r} was created by another enqueue meanwhile with other "
                              "settings; nothing was queued by this one. Run it again to see which differ.")
        self.config, self._create = stored, False

    def _unique(self, group: list[Row]) -> list[Row]:
        """The first row of each id in `group`; repeats are counted or rejected here (the rows held back
        from an earlier group come first, so the first line of an id wins)."""
        seen: dict[str, bytes] = {}
        unique = []
        for row in group:
            earlier = seen.get(row.prompt.id)
            if earlier is None:
                seen[row.prompt.id] = row.digest
                unique.append(row)
            elif earlier == row.digest:
                self.summary.skipped_duplicate += 1
            else:
                self._reject(_conflict(row, "earlier in this input"))
        return unique

    def _batches(self, pipe: redis.client.Pipeline, rows: list[Row]) -> list[BatchSource]:
        size, job = self.config.batch_size, self.config.name
        last = max(ledger_jobs.last_batch_number(pipe, job), self._floor)
        created = time.time()
        out = []
        for n, i in enumerate(range(0, len(rows), size)):
            bid, part = batch_id(last + 1 + n), rows[i : i + size]
            if self.reference is None:
                out.append(BatchSource.inline(job, bid, [r.prompt for r in part], created))
                continue
            ref = InputRange(uri=self.reference, start=part[0].start, end=part[-1].end,
                             first_line=part[0].prompt.index + 1, last_line=part[-1].prompt.index + 1,
                             digest=range_digest(part))
            out.append(BatchSource.by_reference(job, bid, [r.prompt.id for r in part], ref, created))
        return out


def queue_lost(conn: redis.Redis, config: JobConfig) -> int:
    """Queue again what Redis lost of this life of the job (a snapshot restored, a lagging replica
    promoted); returns the prompts queued. An enqueue record naming batches neither Redis nor the
    output knows has its input read again (a requeue's record: its letters requeued), then names
    what stands for them. An enqueue between its record and its transaction looks the same: reading
    its input again queues nothing. Run by genq.ops.recover.OutputWatch."""
    store = open_store(config.output, config.s3_endpoint_url)
    records = {run: r for run, r in truth.read_enqueues(store, config.name).items()
               if r.incarnation == config.incarnation}
    if not records:
        return 0
    known = ledger_jobs.all_batches(conn, config.name) | truth.marker_batches(store, config.name)
    queued = 0
    for run, record in records.items():
        lost = [b for b in truth.recorded_batches(record) if b not in known]
        if not lost:
            continue
        if record.letters:  # a requeue's: its letters are back in the DLQ with the state Redis was restored to
            wanted = set(record.letters)
            back = [e for e in dlq.dead_letters(conn, config.name) if e.id in wanted]
            again = sum(dlq.requeue(conn, back).prompts.values()) if back else 0
        elif record.input:
            again = enqueue_again(conn, config, record.input).enqueued
        else:
            log.error("job %s: Redis lost batches %s of an enqueue whose input is not recorded; enqueue it again",
                      config.name, ", ".join(lost[:8]))
            continue
        truth.write_enqueue(store, config.name, run, msgspec.structs.replace(
            record, batches=truth.batch_ranges(b for b in truth.recorded_batches(record) if b not in lost)))
        queued += again
        log.warning("job %s: Redis lost %d batches of %s (restored from an older state?); queued its %d prompts "
                    "with neither an outcome nor a batch again", config.name, len(lost),
                    f"the enqueue of {record.input}" if record.input else "a requeue of dead letters", again)
    return queued


def enqueue_again(conn: redis.Redis, config: JobConfig, input_uri: str, reference: str | None = None) -> EnqueueSummary:
    """What the job does not hold of one of its inputs (`located`), queued again; rejects go to the
    input's default rejects file."""
    rejects = RejectsFile(os.path.abspath(default_rejects_path(input_uri, config.output, config.name)))
    rows = open_rows(input_uri, endpoint=config.endpoint, s3_endpoint_url=config.s3_endpoint_url)
    summary = Enqueuer(conn, config, create=False, rejects=rejects, reference=reference, input_uri=input_uri).run(rows)
    rejects.close()
    return summary


def revives(on_disk: JobRecord | None, config: JobConfig) -> bool:
    """Whether an enqueue of a job Redis does not know takes up the job its job.json describes: one
    with the same settings, not deleted (`genq jobs delete`; `genq recover` can)."""
    return on_disk is not None and on_disk.deleted_at is None and _settings(on_disk.config) == _settings(config)


def _settings(config: JobConfig) -> JobConfig:
    """A config without when, which life and which `genq jobs set`: an enqueue asking for a job's
    current settings (after `jobs set`) is that job."""
    return msgspec.structs.replace(config, created_at=0.0, incarnation="", settings_version=1, settings_history=[])


def _conflict(row: Row, where: str) -> Rejected:
    # The whole line is kept: it is valid, and may be queued again under another id.
    return Rejected(line=row.prompt.index + 1, reason=f"duplicate id {row.prompt.id!r} with different content ({where})",
                    text=row.text())


def _read_ahead(chunks: Iterator[T]) -> Iterator[T]:
    """The chunks, each read in a thread at most READ_AHEAD chunks ahead of the consumer; its
    exceptions are raised here, and it stops when the consumer does."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="genq-enqueue-read")
    try:
        ahead = deque(pool.submit(next, chunks, None) for _ in range(READ_AHEAD))
        while (chunk := ahead.popleft().result()) is not None:
            ahead.append(pool.submit(next, chunks, None))
            yield chunk
    finally:
        pool.shutdown(cancel_futures=True)


def _chunks(rows: Iterable[Row | Rejected], meter: Meter) -> Iterator[tuple[list[Row | Rejected], int]]:
    """READ_CHUNK rows at a time, each chunk with the meter's position right after its last row."""
    rows = iter(rows)
    while chunk := list(islice(rows, READ_CHUNK)):
        yield chunk, meter.position()
