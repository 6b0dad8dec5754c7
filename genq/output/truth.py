"""The output is the durable truth of a job: what is written there was generated, whatever Redis
says or forgets (docs/recovery.md).

- job.json (durable.JobRecord) is written before the job's first batch is queued: its settings and
  incarnation, its inputs, and the batch numbers that may be in use (raised before any batch above
  them is queued). `genq jobs set` replaces its settings before Redis's: they are the current ones.
- A shard's marker (durable.ShardMarker) is the commit of a batch: created once, never replaced,
  naming the shard it describes, and carrying what rebuilding the ledger needs without reading the
  shard (incarnation, each outcome's content digest, the dead letters with their prompts, per-worker
  tallies, the length histogram).
- A shard is never overwritten with other bytes: the second writer's copy goes under another name
  and the marker decides which counts.
- enqueues/RUN.json (durable.EnqueueRecord) names the batches of one enqueue before they are queued.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol

import msgspec

from genq.core.batches import batch_id, batch_number
from genq.core.records import (
    DeadLetter,
    EnqueueRecord,
    JobConfig,
    JobRecord,
    Result,
    ShardInfo,
    ShardMarker,
    length_bucket,
)
from genq.output import layout

READ_THREADS = 8
RESERVE_STEP = 1024  # batch numbers reserved in job.json at a time: one write per this many batches

_json = msgspec.json.Encoder()
_marker_decoder = msgspec.json.Decoder(ShardMarker)
_job_decoder = msgspec.json.Decoder(JobRecord)
_enqueue_decoder = msgspec.json.Decoder(EnqueueRecord)


class Store(Protocol):
    """A job output's objects, by path relative to the output (JOB/manifest/b0000001.json)."""

    def uri(self, rel: str) -> str: ...
    def read(self, rel: str) -> bytes | None: ...
    def create(self, rel: str, data: bytes) -> bool: ...  # False: something is there already
    def put(self, rel: str, data: bytes) -> None: ...
    def names(self, rel_dir: str) -> list[str]: ...  # file names directly under rel_dir
    def open(self, rel: str) -> BinaryIO: ...  # a stream of a large object (a shard)


class AlreadyWritten(Exception):
    """The batch's marker exists and describes other bytes: that shard is the batch's."""

    def __init__(self, marker: ShardMarker) -> None:
        super().__init__(f"batch {marker.batch} was written already ({marker.records} records, {marker.uri})")
        self.marker = marker


@dataclass
class Outcome:
    """What a batch's marker says beyond its ShardInfo (durable.ShardMarker's fields)."""

    prompts: int = 0  # the batch's prompt count
    digests: dict[str, str] = field(default_factory=dict)
    letters: list[DeadLetter] = field(default_factory=list)
    tally: dict[str, list[int]] = field(default_factory=dict)
    hist: dict[int, int] = field(default_factory=dict)


def outcome_of(results: Iterable[Result], letters: Iterable[DeadLetter], digests: dict[str, bytes],
               prompts: int) -> Outcome:
    """A batch's outcome for its marker; digests: prompt id -> 8-byte content digest
    (producer.rows.claim_digest) of the prompts known; prompts: the batch's prompt count."""
    out = Outcome(prompts=prompts, letters=list(letters))
    for r in results:
        counts = out.tally.setdefault(r.worker, [0, 0, 0])
        counts[0] += 1
        counts[1] += r.usage.prompt_tokens
        counts[2] += r.usage.completion_tokens
        bucket = length_bucket(r.usage.completion_tokens)
        out.hist[bucket] = out.hist.get(bucket, 0) + 1
        if r.id in digests:
            out.digests[r.id] = digests[r.id].hex()
    for d in out.letters:
        if d.id in digests:
            out.digests[d.id] = digests[d.id].hex()
    return out


def shard_info(marker: ShardMarker) -> ShardInfo:
    """The part of a marker Redis keeps (keys.job_shards)."""
    return ShardInfo(batch=marker.batch, uri=marker.uri, records=marker.records, bytes=marker.bytes, at=marker.at,
                     prompts=marker.prompts, letters=marker.letters, incarnation=marker.incarnation)


def commit_shard(store: Store, job: str, batch: str, data: bytes, records: int, at: float, *,
                 compression: str, incarnation: str, outcome: Outcome | None) -> ShardInfo:
    """Write a batch's shard, then create its marker; the ShardInfo for the ledger. The same bytes
    written again are a no-op; raises AlreadyWritten when the marker is of other bytes (that shard
    stands: genq.ops.recover adopts it)."""
    sha = hashlib.sha256(data).hexdigest()
    marker_at = marker_rel(job, batch)
    existing = read_marker(store, marker_at)
    if existing is not None:
        return _same_or_raise(existing, sha, data, records)
    shard_rel = f"{job}/{layout.SHARDS_DIR}/{layout.shard_name(batch, compression)}"
    if not store.create(shard_rel, data) and store.read(shard_rel) != data:
        # Another writer's bytes, with no marker yet (or never): leave them, write ours beside.
        shard_rel = f"{job}/{layout.SHARDS_DIR}/{layout.shard_name(batch, compression, sha[:12])}"
        store.put(shard_rel, data)
    outcome = outcome or Outcome()
    marker = ShardMarker(batch=batch, uri=store.uri(shard_rel), records=records, bytes=len(data), at=at,
                         prompts=outcome.prompts, incarnation=incarnation, sha256=sha, digests=outcome.digests,
                         letters=len(outcome.letters), dead_letters=outcome.letters,
                         tally=outcome.tally, hist=outcome.hist)
    if not store.create(marker_at, _json.encode(marker) + b"\n"):
        raced = read_marker(store, marker_at)
        if raced is not None:
            return _same_or_raise(raced, sha, data, records)
    return shard_info(marker)


def _same_or_raise(existing: ShardMarker, sha: str, data: bytes, records: int) -> ShardInfo:
    same = existing.sha256 == sha if existing.sha256 else (existing.bytes, existing.records) == (len(data), records)
    if not same:
        raise AlreadyWritten(existing)
    return shard_info(existing)


def marker_rel(job: str, batch: str) -> str:
    return f"{job}/{layout.MANIFEST_DIR}/{batch}.json"


def read_marker(store: Store, rel: str) -> ShardMarker | None:
    raw = store.read(rel)
    return _marker_decoder.decode(raw) if raw else None


def marker_batches(store: Store, job: str) -> set[str]:
    """The batches with a marker in the job's manifest."""
    found = (layout.batch_of_marker(n) for n in store.names(f"{job}/{layout.MANIFEST_DIR}"))
    return {b for b in found if b}


def read_markers(store: Store, job: str, batches: Iterable[str]) -> list[ShardMarker]:
    rels = [marker_rel(job, b) for b in sorted(batches)]
    with ThreadPoolExecutor(READ_THREADS) as pool:
        return [m for m in pool.map(lambda rel: read_marker(store, rel), rels) if m is not None]


def of_life(markers: Iterable[ShardMarker], config: JobConfig) -> list[ShardMarker]:
    """The markers of this life of the job (another life of the name may have used the same folder
    with other settings: those results are not this job's)."""
    return [m for m in markers if m.incarnation == config.incarnation]


def job_uri(store: Store, job: str) -> str:
    return store.uri(f"{job}/{layout.JOB_FILE}")


def read_job(store: Store, job: str) -> JobRecord | None:
    raw = store.read(f"{job}/{layout.JOB_FILE}")
    return _job_decoder.decode(raw) if raw else None


def write_job(store: Store, record: JobRecord) -> None:
    store.put(f"{record.config.name}/{layout.JOB_FILE}", _json.encode(record) + b"\n")


def mark_deleted(store: Store, job: str, at: float | None, incarnation: str | None = None) -> bool:
    """job.json says the job was deleted at `at` (None: it lives again); False when there is none
    (or it is of another life than `incarnation`, when given)."""
    on_disk = read_job(store, job)
    if on_disk is None or (incarnation is not None and on_disk.config.incarnation != incarnation):
        return False
    if on_disk.deleted_at != at:
        write_job(store, msgspec.structs.replace(on_disk, deleted_at=at))
    return True


def reserve(store: Store, record: JobRecord, upto: int) -> JobRecord:
    """job.json saying batch numbers up to at least `upto` may be in use (written before they are
    queued), as written. Never lowers what is there, nor writes older settings over newer ones
    (`genq jobs set` during this enqueue)."""
    on_disk = read_job(store, record.config.name)
    if on_disk is not None and on_disk.config.incarnation == record.config.incarnation:
        config = on_disk.config if on_disk.config.settings_version > record.config.settings_version else record.config
        record = msgspec.structs.replace(record, config=config, reserved=max(record.reserved, on_disk.reserved),
                                         inputs=sorted(set(record.inputs) | set(on_disk.inputs)))
    if record.reserved >= upto and on_disk is not None and on_disk == record:
        return record
    record = msgspec.structs.replace(record, reserved=max(record.reserved, upto))
    write_job(store, record)
    return record


def batch_ranges(batches: Iterable[str]) -> list[list[int]]:
    """Batch ids as [first, last] number ranges (an enqueue's are consecutive: a record stays small)."""
    out: list[list[int]] = []
    for n in sorted(map(batch_number, batches)):
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        elif not out or n > out[-1][1]:
            out.append([n, n])
    return out


def recorded_batches(record: EnqueueRecord) -> list[str]:
    return [batch_id(n) for first, last in record.batches for n in range(first, last + 1)]


def write_enqueue(store: Store, job: str, run: str, record: EnqueueRecord) -> None:
    store.put(f"{job}/{layout.ENQUEUES_DIR}/{run}.json", _json.encode(record) + b"\n")


def read_enqueues(store: Store, job: str) -> dict[str, EnqueueRecord]:
    """Every enqueue record of the job's folder, by run."""
    out = {}
    for name in sorted(store.names(f"{job}/{layout.ENQUEUES_DIR}")):
        raw = store.read(f"{job}/{layout.ENQUEUES_DIR}/{name}") if name.endswith(".json") else None
        if raw:
            out[name.removesuffix(".json")] = _enqueue_decoder.decode(raw)
    return out
