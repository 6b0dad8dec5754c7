"""A job's output, the durable truth of what was generated whatever Redis forgets (docs/recovery.md):
OUTPUT/JOB/shards/BATCH.jsonl[.gz], their markers manifest/BATCH.json (created once: the batch's commit),
job.json, enqueues/RUN.json and rejects/; a local folder here, S3 in genq.output.s3. Readers read only
the shards a marker names; batch numbers are never reused, and a shard never overwritten with other bytes."""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import os
import secrets
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import msgspec

from genq.core.records import (
    DeadLetter,
    EnqueueRecord,
    JobConfig,
    JobRecord,
    Result,
    ShardInfo,
    ShardMarker,
    batch_id,
    batch_number,
    length_bucket,
)

SHARDS_DIR, MANIFEST_DIR, ENQUEUES_DIR, REJECTS_DIR, JOB_FILE = "shards", "manifest", "enqueues", "rejects", "job.json"
READ_THREADS = 8
RESERVE_STEP = 1024  # batch numbers reserved in job.json at a time: one write per this many batches

_json = msgspec.json.Encoder()


class Store(Protocol):
    """A job output's objects, by path relative to the output (JOB/manifest/b0000001.json)."""

    def uri(self, rel: str) -> str: ...
    def read(self, rel: str) -> bytes | None: ...
    def create(self, rel: str, data: bytes) -> bool: ...  # False: something is there already
    def put(self, rel: str, data: bytes) -> None: ...
    def swap(self, rel: str, change: Callable[[bytes | None], bytes | None]) -> None: ...  # one writer at a time
    def names(self, rel_dir: str) -> list[str]: ...  # file names directly under rel_dir
    def open(self, rel: str) -> BinaryIO: ...  # a stream of a large object (a shard)


def open_store(output: str, endpoint_url: str | None = None) -> Store:
    """A job output (a folder or s3://bucket/prefix); never raises: a bad one fails when used."""
    if output.startswith("s3://"):
        from genq.output.s3 import S3Store  # boto3 only when an output is on S3

        return S3Store(output, endpoint_url)
    return LocalStore(output)


def job_root(output: str, job: str) -> str:
    return f"{output.rstrip('/')}/{job}"


def write_atomic(path: str | os.PathLike[str], data: bytes | Callable[[BinaryIO], Any], *, create: bool = False) -> Any:
    """Write `data` (bytes, or a function writing to the open file) whole over `path` by a rename; what it
    returned. create: only if nothing is there (a hard link), False when something is."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Created as open() creates one (0666 less the umask; mkstemp's 0600 would travel with the rename).
    tmp = str(target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as out:
            value = out.write(data) if isinstance(data, bytes) else data(out)
            out.flush()
            os.fsync(out.fileno())
        if not create:
            os.replace(tmp, path)
            return value
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
    finally:
        Path(tmp).unlink(missing_ok=True)


class LocalStore:
    """A local (or shared) output folder as a Store."""

    def __init__(self, root: str) -> None:
        self.root = root

    def uri(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}"

    def read(self, rel: str) -> bytes | None:
        try:
            return Path(self.uri(rel)).read_bytes()
        except FileNotFoundError:
            return None

    def create(self, rel: str, data: bytes) -> bool:
        return bool(write_atomic(self.uri(rel), data, create=True))

    def put(self, rel: str, data: bytes) -> None:
        write_atomic(self.uri(rel), data)

    def swap(self, rel: str, change: Callable[[bytes | None], bytes | None]) -> None:
        """`rel` replaced by change(what is there) (None: left), under a lock on .NAME.lock beside it."""
        lock_at = Path(self.uri(rel)).with_name(f".{Path(rel).name}.lock")
        lock_at.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_at, "ab") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, or when the process dies
            if (new := change(self.read(rel))) is not None:
                self.put(rel, new)

    def names(self, rel_dir: str) -> list[str]:
        try:
            return sorted(os.listdir(self.uri(rel_dir)))
        except FileNotFoundError:
            return []

    def open(self, rel: str) -> BinaryIO:
        return open(self.uri(rel), "rb")


class AlreadyWritten(Exception):
    """The batch's marker exists and describes other bytes: that shard is the batch's."""

    def __init__(self, marker: ShardMarker) -> None:
        super().__init__(f"batch {marker.batch} was written already ({marker.records} records, {marker.uri})")
        self.marker = marker


def shard_bytes(results: list[Result], compression: str) -> bytes:
    data = b"".join(_json.encode(r) + b"\n" for r in sorted(results, key=lambda r: r.index))
    return gzip.compress(data, mtime=0) if compression == "gzip" else data  # mtime=0: same results, same bytes


def outcome_of(results: Iterable[Result], letters: Iterable[DeadLetter], digests: dict[str, bytes],
               prompts: int) -> ShardMarker:
    """A batch's marker but for where its shard is (commit_shard fills that in); digests: prompt id -> digest."""
    dead = list(letters)
    out = ShardMarker(batch="", uri="", records=0, bytes=0, at=0.0, prompts=prompts, letters=len(dead),
                      dead_letters=dead)
    for r in results:
        counts = out.tally.setdefault(r.worker, [0, 0, 0])
        counts[0] += 1
        counts[1] += r.usage.prompt_tokens
        counts[2] += r.usage.completion_tokens
        bucket = length_bucket(r.usage.completion_tokens)
        out.hist[bucket] = out.hist.get(bucket, 0) + 1
    out.digests = {i: digests[i].hex() for i in [*(r.id for r in results), *(d.id for d in dead)] if i in digests}
    return out


def shard_info(marker: ShardMarker) -> ShardInfo:
    return ShardInfo(**{name: getattr(marker, name) for name in ShardInfo.__struct_fields__})


def commit_shard(store: Store, job: str, batch: str, data: bytes, records: int, at: float, *,
                 compression: str, incarnation: str, outcome: ShardMarker | None) -> ShardInfo:
    """Write a batch's shard, then create its marker; the same bytes again are a no-op, AlreadyWritten when the
    marker is of other bytes (that shard stands: recover adopts it)."""
    sha, suffix = hashlib.sha256(data).hexdigest(), ".jsonl.gz" if compression == "gzip" else ".jsonl"
    marker_at, shard_rel = marker_rel(job, batch), f"{job}/{SHARDS_DIR}/{batch}{suffix}"
    marker = read_marker(store, marker_at)
    if marker is None:
        if not store.create(shard_rel, data) and store.read(shard_rel) != data:
            # Another writer's bytes, with no marker yet (or never): leave them, write ours beside.
            shard_rel = f"{job}/{SHARDS_DIR}/{batch}.{sha[:12]}{suffix}"
            store.put(shard_rel, data)
        marker = msgspec.structs.replace(
            outcome or ShardMarker(batch, "", 0, 0, 0.0), batch=batch, uri=store.uri(shard_rel), records=records,
            bytes=len(data), at=at, incarnation=incarnation, sha256=sha)
        if store.create(marker_at, _json.encode(marker) + b"\n") or (raced := read_marker(store, marker_at)) is None:
            return shard_info(marker)
        marker = raced
    same = marker.sha256 == sha if marker.sha256 else (marker.bytes, marker.records) == (len(data), records)
    if not same:
        raise AlreadyWritten(marker)
    return shard_info(marker)


def marker_rel(job: str, batch: str) -> str:
    return f"{job}/{MANIFEST_DIR}/{batch}.json"


def batch_of_marker(name: str) -> str | None:
    """The batch a manifest file name stands for; None for what is not a marker."""
    return None if name.startswith(".") or not name.endswith(".json") else name.removesuffix(".json")


def read_marker(store: Store, rel: str) -> ShardMarker | None:
    raw = store.read(rel)
    return msgspec.json.decode(raw, type=ShardMarker) if raw else None


def marker_batches(store: Store, job: str) -> set[str]:
    return {b for n in store.names(f"{job}/{MANIFEST_DIR}") if (b := batch_of_marker(n))}


def read_markers(store: Store, job: str, batches: Iterable[str]) -> list[ShardMarker]:
    rels = [marker_rel(job, b) for b in sorted(batches)]
    with ThreadPoolExecutor(READ_THREADS) as pool:
        return [m for m in pool.map(lambda rel: read_marker(store, rel), rels) if m is not None]


def of_life(markers: Iterable[ShardMarker], config: JobConfig) -> list[ShardMarker]:
    """The markers of this life of the job (another life of the name may have used the same folder)."""
    return [m for m in markers if m.incarnation == config.incarnation]


def job_uri(store: Store, job: str) -> str:
    return store.uri(f"{job}/{JOB_FILE}")


def read_job(store: Store, job: str) -> JobRecord | None:
    raw = store.read(f"{job}/{JOB_FILE}")
    return msgspec.json.decode(raw, type=JobRecord) if raw else None


def update_job(store: Store, job: str, change: Callable[[JobRecord | None], JobRecord | None]) -> JobRecord | None:
    """job.json replaced by change(job.json as it is now) (None, or the same: left), one writer at a time
    (Store.swap): each of its writers (`jobs set`, pause, a pin, reserve) changes only its own fields of the
    latest record, so none undoes another's change made meanwhile. What job.json holds after."""
    after: list[JobRecord | None] = [None]

    def swap(raw: bytes | None) -> bytes | None:
        new = change(old := msgspec.json.decode(raw, type=JobRecord) if raw else None)
        after[0] = old if new is None else new
        return None if new is None or new == old else _json.encode(new) + b"\n"

    store.swap(f"{job}/{JOB_FILE}", swap)
    return after[0]


def newer_config(mine: JobConfig, there: JobConfig) -> JobConfig:
    """Of two configs of one life of a job, the later settings version (a pinned model over `auto`)."""
    return max(there, mine, key=lambda c: (c.settings_version, c.model != "auto"))  # a tie: there


def mark_deleted(store: Store, job: str, at: float | None, incarnation: str | None = None) -> bool:
    """job.json says the job was deleted at `at` (None: it lives again); False when there is none (of incarnation)."""
    def change(on_disk: JobRecord | None) -> JobRecord | None:
        if on_disk is None or (incarnation is not None and on_disk.config.incarnation != incarnation):
            return None
        return msgspec.structs.replace(on_disk, deleted_at=at)

    found = update_job(store, job, change)
    return found is not None and incarnation in (None, found.config.incarnation)


def reserve(store: Store, record: JobRecord, upto: int) -> JobRecord:
    """job.json saying batch numbers up to `upto` may be in use, as written; never lowering what is there, nor
    writing older settings over newer ones (newer_config); the rest (schedule, pause) as job.json has it."""
    def change(on_disk: JobRecord | None) -> JobRecord:
        new = record
        if on_disk is not None and on_disk.config.incarnation == record.config.incarnation:
            new = msgspec.structs.replace(on_disk, config=newer_config(record.config, on_disk.config),
                                          reserved=max(record.reserved, on_disk.reserved),
                                          inputs=sorted(set(record.inputs) | set(on_disk.inputs)))
        return msgspec.structs.replace(new, reserved=max(new.reserved, upto))

    return update_job(store, record.config.name, change) or record


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
    store.put(f"{job}/{ENQUEUES_DIR}/{run}.json", _json.encode(record) + b"\n")


def read_enqueues(store: Store, job: str) -> dict[str, EnqueueRecord]:
    names = [n for n in store.names(f"{job}/{ENQUEUES_DIR}") if n.endswith(".json")]
    raws = {n.removesuffix(".json"): store.read(f"{job}/{ENQUEUES_DIR}/{n}") for n in sorted(names)}
    return {run: msgspec.json.decode(raw, type=EnqueueRecord) for run, raw in raws.items() if raw}
