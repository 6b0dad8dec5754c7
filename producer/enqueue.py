"""Idempotent enqueue: ids are claimed in the transaction that writes their batches, under WATCH (each id queued
once, even with two enqueues or a crash; other content under a known id is rejected). job.json reserves a batch's
number and enqueues/RUN.json names it before it is queued, so what Redis loses is found there (queue_lost)."""

from __future__ import annotations

import heapq
import logging
import os
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import BinaryIO, TypeVar

import msgspec
import redis

from genq.core.ledger import jobs as ledger_jobs
from genq.core.order import order_queue
from genq.core.queueing import ID_NEW, ID_OTHER, ID_SAME, load_config, lookup_ids, save_config, write_batches
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
from genq.producer.rows import UNSENT_AT_TOP, Row
from genq.producer.sources import Meter, default_rejects_path, open_rows, range_digest

log = logging.getLogger("genq.enqueue")

READ_CHUNK = 8192  # rows read before queueing what is ready
READ_AHEAD = 2  # chunks the reading thread may have ready: bounds the rows held
GROUP_BATCHES = 32  # batches per transaction: keeps a MULTI a sensible size (and the rows held)
SHOWN = 20  # the first rejects kept for the terminal; the file has them all

T = TypeVar("T")
_encoder = msgspec.json.Encoder()


class JobConflict(ValueError):
    """Another enqueue created the job meanwhile with other settings."""


class JobClosed(ValueError):
    """New prompts for a finished job whose enqueue did not say to add them (the message says how)."""


class RejectsFile:
    """Rejects written sorted by line to PATH.partial, renamed at `close`; a write error is kept, not raised."""

    def __init__(self, path: str | None) -> None:
        self.path, self.count = path, 0
        self.error: OSError | None = None
        self.first: list[Rejected] = []  # the SHOWN lowest lines
        self._held: list[tuple[int, int, Rejected]] = []  # a heap by line
        self._out: BinaryIO | None = None
        self._made: list[Path] = []  # the folders this created, deepest first

    def add(self, rejected: Rejected) -> None:
        self.count += 1
        heapq.heappush(self._held, (rejected.line, self.count, rejected))

    def release(self, below_line: int | None) -> None:
        """Write the rejects of lines before below_line (None: all of them)."""
        while self._held and (below_line is None or self._held[0][0] < below_line):
            rejected = heapq.heappop(self._held)[2]
            if len(self.first) < SHOWN:
                self.first.append(rejected)
            if self.error is not None or self.path is None:
                continue
            try:
                if self._out is None:
                    folder = Path(self.path).parent
                    self._made = [p for p in (folder, *folder.parents) if not p.exists()]
                    folder.mkdir(parents=True, exist_ok=True)
                    self._out = open(f"{self.path}.partial", "wb")  # noqa: SIM115 (closed in close/discard)
                self._out.write(_encoder.encode(rejected) + b"\n")
            except OSError as exc:
                self.error = exc

    def close(self) -> None:
        self.release(None)
        if self._out is not None and self.path is not None:
            self._out.close()
            self._out = None
            try:
                os.replace(f"{self.path}.partial", self.path)
            except OSError as exc:
                self.error = exc

    def discard(self) -> None:
        self._held.clear()
        if self._out is not None:
            self._out.close()
            self._out = None
            Path(f"{self.path}.partial").unlink(missing_ok=True)
        for folder in self._made:
            try:
                folder.rmdir()
            except OSError:
                break


@dataclass
class EnqueueSummary:
    read: int = 0  # valid rows
    enqueued: int = 0
    batches: int = 0
    converted: int = 0  # 'prompt' rows sent as one user message (chat endpoint)
    unsent: Counter[str] = field(default_factory=Counter)  # request fields at a row's top level: metadata, not sent
    models: Counter[str] = field(default_factory=Counter)  # OpenAI Batch bodies' models, with --model auto
    skipped_existing: int = 0  # already queued or done (an earlier run, or far up this input)
    skipped_duplicate: int = 0  # same id, same content, close together in this input
    rejected: int = 0
    recovered_batches: int = 0  # batches written in the output that Redis did not count as done
    rebuilt: bool = False  # the job was gone from Redis and was created again from OUTPUT/JOB/job.json
    note: str = ""  # something about the output the operator should know


class Enqueuer:
    def __init__(self, conn: redis.Redis, config: JobConfig, *, create: bool, rejects: RejectsFile,
                 reference: str | None = None, input_uri: str | None = None, closed: str | None = None,
                 dry_run: bool = False, model: str | None = None) -> None:
        """reference: the input as workers read it (None: inline); closed: JobClosed(closed) before queueing;
        model: the one OpenAI Batch bodies may name (--model; auto: any, noted; None: unchecked)."""
        self.conn, self.config, self.rejects, self.reference, self.model = conn, config, rejects, reference, model
        self._wrong: set[str] = set()  # ids of rows rejected for their model
        self.summary = EnqueueSummary()
        self._create, self._closed = create, closed
        self._pending: list[Row] = []
        self._store = open_store(config.output, config.s3_endpoint_url)
        self._inputs = [input_uri] if input_uri else []
        self._record = JobRecord(config=config, inputs=self._inputs)
        self._floor = 0  # batch numbers at or below it may be in use in the output folder
        self._run = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"  # enqueues/RUN.json
        self._queued: list[str] = []
        self._dry_claims: dict[str, bytes] | None = {} if dry_run else None  # id -> digest, claimed in memory

    def run(self, rows: Iterable[Row | Rejected], on_progress: Callable[[EnqueueSummary], None] | None = None,
            meter: Meter | None = None) -> EnqueueSummary:
        """Queue `rows`, read in a thread a chunk ahead: Redis's replies and zstd overlap the parsing."""
        if self._dry_claims is None:
            self._reach_output(self._from_output)
        meter, read, summary = meter or Meter(), 0, self.summary
        for items, position in _read_ahead(rows, meter):
            read += len(items)
            meter.read_upto(read, position)
            for item in items:
                if isinstance(item, Rejected):
                    self.rejects.add(item)
                    continue
                if reason := self._wrong_model(item):
                    self.rejects.add(Rejected(line=item.prompt.index + 1, reason=reason, text=item.text()))
                    continue
                if self.reference is not None and item.start < 0:
                    raise ValueError("by-reference batches need an uncompressed JSONL input")
                self._pending.append(item)
                summary.read += 1
                summary.converted += item.converted
                if not UNSENT_AT_TOP.isdisjoint(item.prompt.metadata):
                    summary.unsent.update(UNSENT_AT_TOP.intersection(item.prompt.metadata))
            self._flush(final=False)
            meter.settle(read - len(self._pending))
            # Every reject still to come is of a pending row or a later line.
            self.rejects.release(self._pending[0].prompt.index + 1 if self._pending else None)
            summary.rejected = self.rejects.count
            if on_progress:
                on_progress(summary)
        self._flush(final=True)
        self.rejects.release(None)
        summary.rejected = self.rejects.count
        meter.finish()
        if on_progress:  # the rows of the last, short batch are queued too: 100%
            on_progress(summary)
        return summary

    def _wrong_model(self, row: Row) -> str | None:
        """Why a row is rejected for its OpenAI Batch body's model (genq sends the job's), or None; a later line of its
        id too (a worker reading by reference takes an id's first line in its range). auto: any, noted."""
        if row.prompt.id in self._wrong:
            return f"duplicate id {row.prompt.id!r} of a line rejected for its model"
        if row.model is None or self.model is None or row.model == self.model:
            return None
        if self.model == "auto":
            self.summary.models[row.model] += 1  # unknown until a server takes the job: said at the end
            return None
        self._wrong.add(row.prompt.id)
        return (f"OpenAI Batch body's 'model' {row.model!r} is not the job's --model {self.model!r}, which is what "
                "genq sends: queue it in a job of its own model")

    def _from_output(self) -> None:
        """Adopt batches written in the output that Redis does not count as done, or revive the job from job.json."""
        on_disk, config = truth.read_job(self._store, self.config.name), self.config
        if not self._create:
            self.summary.recovered_batches = len(recover.catch_up(self.conn, config))
            if on_disk and on_disk.config.incarnation == config.incarnation:
                self._record = on_disk
        elif on_disk is not None and revives(on_disk, config):
            recovery = recover.rebuild(self.conn, on_disk)
            self.config, self._record, self._create = recovery.config, on_disk, False
            self.summary.recovered_batches, self.summary.rebuilt = len(recovery.adopted), True
        elif on_disk is not None:
            why = "was deleted (genq jobs delete)" if on_disk.deleted_at is not None else "had other settings"
            self.summary.note = (f"{truth.job_uri(self._store, config.name)} is of an earlier job of this name, "
                                 f"which {why}: this is a new job; the old one's shards stay and are not counted as "
                                 f"done for this one (genq recover --job {config.name} --output "
                                 f"{config.output} would have brought the old one back instead)")
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
        group, size = self._unique(group), self.config.batch_size
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
        if batches:
            self._create = False  # the job exists once a batch is queued
        self.summary.enqueued += len(taking)
        self.summary.batches += batches
        self.summary.skipped_existing += known.count(ID_SAME)
        for row, k in zip(group, known):
            if k == ID_OTHER:
                self.rejects.add(_conflict(row, "queued earlier: farther up this input or in an earlier enqueue of "
                                                "this job"))
        return held

    def _lookup(self, pipe: redis.client.Pipeline, group: list[Row]) -> str:
        """ID_NEW, ID_SAME or ID_OTHER for each row, under WATCH of what the transaction depends on."""
        digests = [(row.prompt.id, row.digest) for row in group]
        if self._dry_claims is None:
            ledger_jobs.watch_enqueue(pipe, self.config.name)
            if self._create and (stored := load_config(pipe, self.config.name)) is not None:
                if _settings(stored) != _settings(self.config):
                    raise JobConflict(f"job {self.config.name!r} was created by another enqueue meanwhile with other "
                                      "settings; nothing was queued by this one. Run it again to see which differ.")
                self.config, self._create = stored, False
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
        upto, record = batch_number(batches[-1].id), self._record
        if upto > record.reserved or not set(self._inputs) <= set(record.inputs):
            record = msgspec.structs.replace(record, config=self.config, inputs=sorted({*record.inputs, *self._inputs}))
            self._record = self._reach_output(lambda: truth.reserve(self._store, record, upto + truth.RESERVE_STEP))
        ids = self._queued + [b.id for b in batches]
        enqueue = EnqueueRecord(incarnation=self.config.incarnation, input=self._inputs[0] if self._inputs else "",
                                batches=truth.batch_ranges(ids), prompts=self.summary.enqueued + len(rows))
        self._reach_output(lambda: truth.write_enqueue(self._store, self.config.name, self._run, enqueue))
        pipe.multi()
        if self._create:
            save_config(pipe, self.config)
        ledger_jobs.stage_last_batch_number(pipe, self.config.name, upto)
        write_batches(pipe, self.conn, batches, {row.prompt.id: row.digest for row in rows})
        pipe.execute()
        self._queued = ids
        return len(batches)

    def _unique(self, group: list[Row]) -> list[Row]:
        """The first row of each id in `group` (the first line of an id wins); repeats counted or rejected here."""
        seen: dict[str, bytes] = {}
        unique = []
        for row in group:
            if (earlier := seen.get(row.prompt.id)) is None:
                seen[row.prompt.id] = row.digest
                unique.append(row)
            elif earlier == row.digest:
                self.summary.skipped_duplicate += 1
            else:
                self.rejects.add(_conflict(row, "earlier in this input"))
        return unique

    def _batches(self, pipe: redis.client.Pipeline, rows: list[Row]) -> list[BatchSource]:
        size, job, created = self.config.batch_size, self.config.name, time.time()
        last = max(ledger_jobs.last_batch_number(pipe, job), self._floor)
        parts = [(batch_id(last + 1 + n), rows[i : i + size]) for n, i in enumerate(range(0, len(rows), size))]
        if self.reference is None:
            return [BatchSource.inline(job, bid, [r.prompt for r in part], created) for bid, part in parts]
        return [BatchSource.by_reference(job, bid, [r.prompt.id for r in part], InputRange(
            uri=self.reference, start=part[0].start, end=part[-1].end, first_line=part[0].prompt.index + 1,
            last_line=part[-1].prompt.index + 1, digest=range_digest(part)), created) for bid, part in parts]


def queue_lost(conn: redis.Redis, config: JobConfig) -> int:
    """Queue again the batches of this life's enqueue records that neither Redis nor the output knows (an older
    snapshot restored): their input read again, or a requeue's letters requeued; how many prompts."""
    store = open_store(config.output, config.s3_endpoint_url)
    records = {run: r for run, r in truth.read_enqueues(store, config.name).items()
               if r.incarnation == config.incarnation}
    if not records:
        return 0
    known = ledger_jobs.all_batches(conn, config.name) | truth.marker_batches(store, config.name)
    queued = 0
    for run, record in records.items():
        if not (lost := [b for b in truth.recorded_batches(record) if b not in known]):
            continue
        if record.letters:  # a requeue's: its letters are back in the DLQ with the state Redis was restored to
            wanted = set(record.letters)
            back = [e for e in dlq.dead_letters(conn, config.name) if e.id in wanted]
            again = sum(dlq.requeue(conn, back, record.override).prompts.values()) if back else 0
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
    """What the job does not hold of one of its inputs (`located`), queued again."""
    rejects = RejectsFile(os.path.abspath(default_rejects_path(input_uri, config.output, config.name)))
    rows = open_rows(input_uri, endpoint=config.endpoint, s3_endpoint_url=config.s3_endpoint_url, job=config.extra_body)
    summary = Enqueuer(conn, config, create=False, rejects=rejects, reference=reference, input_uri=input_uri).run(rows)
    rejects.close()
    if summary.enqueued:
        order_queue(conn)  # its batches in their place among the other jobs' (priority first)
    return summary


def revives(on_disk: JobRecord | None, config: JobConfig) -> bool:
    """Whether an enqueue of a job Redis does not know takes up its job.json's: same settings, not deleted."""
    if config.model == "auto" and on_disk is not None:  # a pinned model is what `auto` became
        config = msgspec.structs.replace(config, model=on_disk.config.model)
    return on_disk is not None and on_disk.deleted_at is None and _settings(on_disk.config) == _settings(config)


def _settings(config: JobConfig) -> JobConfig:
    """A config without when, which life and which `genq jobs set`: what two enqueues of one job share."""
    return msgspec.structs.replace(config, created_at=0.0, incarnation="", settings_version=1, settings_history=[])


def _conflict(row: Row, where: str) -> Rejected:
    # The whole line is kept: it is valid, and may be queued again under another id.
    reason = f"duplicate id {row.prompt.id!r} with different content ({where})"
    return Rejected(line=row.prompt.index + 1, reason=reason, text=row.text())


def _read_ahead(rows: Iterable[Row | Rejected], meter: Meter) -> Iterator[tuple[list[Row | Rejected], int]]:
    """READ_CHUNK rows at a time with the meter's position after them, read in a thread READ_AHEAD ahead."""
    rows = iter(rows)

    def chunk() -> tuple[list[Row | Rejected], int] | None:
        items = list(islice(rows, READ_CHUNK))
        return (items, meter.position()) if items else None

    pool = ThreadPoolExecutor(1, thread_name_prefix="genq-enqueue-read")
    try:
        ahead = deque(pool.submit(chunk) for _ in range(READ_AHEAD))
        while (got := ahead.popleft().result()) is not None:
            ahead.append(pool.submit(chunk))
            yield got
    finally:
        pool.shutdown(cancel_futures=True)
