"""Merge a job's finished shards into one file: JSONL, Parquet or OpenAI Batch output.

Which shards: those named by the manifest markers (OUTPUT/JOB/manifest/*.json,
see genq.output.layout), never a bare listing of shards/: a shard without
a marker may be half written. Each shard is checked against its marker (bytes
and record count) before anything is exported.

How: shards are read once (S3 objects and .gz shards are spooled, uncompressed,
to a temporary folder beside the destination), remembering for each record its
id, input index and place in the spool; ids seen before are dropped (the first
copy wins: shards are read in the order of their last outcome, ShardInfo.at, the
first result of a prompt first); the kept records are then sorted (input order: by
Result.index) and copied out. Memory holds one small tuple per record, never
the records themselves.

Formats: genq.output.formats.
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import msgspec

from genq.core.records import DeadLetter, Result, ShardInfo
from genq.output.formats import FORMATS, openai_error_line
from genq.output.layout import MANIFEST_DIR, SHARDS_DIR, job_root
from genq.output.local import write_atomic

ORDERS = ("input", "batch")
DOWNLOAD_THREADS = 8

_json = msgspec.json.Encoder()
_result_decoder = msgspec.json.Decoder(Result)
_info_decoder = msgspec.json.Decoder(ShardInfo)


class ExportError(Exception):
    """Something the operator must look at (a shard that disagrees with its marker...)."""


class _Key(msgspec.Struct):
    """What the first pass decodes of each record: the rest is skipped unparsed."""

    id: str
    index: int


_key_decoder = msgspec.json.Decoder(_Key)


class ShardRef(NamedTuple):
    info: ShardInfo
    location: str  # where the shard is read from (resolved beside its marker)


class Entry(NamedTuple):
    line: int  # the prompt's position in the input (Result.index)
    shard: int
    offset: int
    length: int


@dataclass
class ExportSummary:
    path: str = ""
    records: int = 0
    bytes: int = 0
    shards: int = 0
    duplicates: int = 0
    errors_path: str | None = None
    errors: int = 0
    skipped_errors: int = 0  # dead letters whose id also has a result
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ manifest


def list_shards(output: str, job: str, endpoint_url: str | None = None,
                incarnation: str | None = None) -> list[ShardRef]:
    """The shards named by the job's manifest markers, the first written first (a prompt
    generated twice, by a genq before #31, is exported once: its first result). With
    `incarnation`, only the markers of that life of the job (and of a genq that wrote none):
    another life of the name may have used the folder with other settings."""
    root = job_root(output, job)
    if output.startswith("s3://"):
        from genq.output import s3

        prefix = f"{root}/{MANIFEST_DIR}/"
        bucket, _ = s3.parse_uri(root)
        markers = [f"s3://{bucket}/{key}" for key, _ in s3.list_keys(prefix, endpoint_url) if key.endswith(".json")]
        with ThreadPoolExecutor(DOWNLOAD_THREADS) as pool:
            raws = list(pool.map(lambda uri: s3.read_object(uri, endpoint_url), markers))
    else:
        folder = Path(root) / MANIFEST_DIR
        paths = sorted(p for p in folder.glob("*.json") if not p.name.startswith("."))
        markers = [str(p) for p in paths]
        raws = [p.read_bytes() for p in paths]
    if not markers:
        raise ExportError(f"no shards to export: {root}/{MANIFEST_DIR}/ is empty or missing "
                          f"(no batch of job {job!r} has finished there yet, or the output is elsewhere: see --from)")
    refs = []
    for marker, raw in zip(markers, raws):
        try:
            info = _info_decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise ExportError(f"manifest marker {marker} is not a ShardInfo: {exc}") from None
        # Resolve the shard beside its marker rather than trusting info.uri: an
        # output folder or bucket that was copied elsewhere still exports.
        name = info.uri.rstrip("/").rsplit("/", 1)[-1]
        refs.append(ShardRef(info, f"{root}/{SHARDS_DIR}/{name}"))
    refs = [r for r in refs if incarnation is None or r.info.incarnation in ("", incarnation)]
    if not refs:
        raise ExportError(f"no shards of this life of job {job!r} (incarnation {incarnation}) in {root}/{MANIFEST_DIR}/: "
                          "the markers there are of an earlier job of that name")
    refs.sort(key=lambda r: (r.info.at, r.info.batch))
    return refs


# ------------------------------------------------------------------ first pass


class _Counting:
    """Counts the raw (maybe compressed) bytes read through it."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream, self.count = stream, 0

    def read(self, n: int = -1) -> bytes:
        data = self.stream.read(n)
        self.count += len(data)
        return data

    def close(self) -> None:
        self.stream.close()


def _materialize(ref: ShardRef, spool: Path, number: int, endpoint_url: str | None) -> tuple[str, int]:
    """A local, uncompressed copy of the shard (the shard itself when it already is one),
    and its stored size in bytes."""
    gz = ref.location.endswith(".gz")
    if not ref.location.startswith("s3://") and not gz:
        path = Path(ref.location)
        if not path.is_file():
            raise ExportError(f"shard {ref.location} named by the manifest is missing")
        return str(path), path.stat().st_size
    if ref.location.startswith("s3://"):
        from genq.output import s3

        try:
            source: BinaryIO = s3.open_stream(ref.location, endpoint_url)
        except Exception as exc:
            raise ExportError(f"cannot read shard {s3.describe(exc, ref.location)}") from None
    else:
        if not Path(ref.location).is_file():
            raise ExportError(f"shard {ref.location} named by the manifest is missing")
        source = open(ref.location, "rb")
    counting = _Counting(source)
    target = spool / f"{number:08d}.jsonl"
    try:
        reader: Any = gzip.GzipFile(fileobj=counting, mode="rb") if gz else counting  # type: ignore[call-overload]
        with open(target, "wb") as out:
            shutil.copyfileobj(reader, out, 1 << 20)
        if reader is not counting:
            reader.close()
    except (OSError, EOFError) as exc:
        raise ExportError(f"shard {ref.location} is unreadable: {exc}") from None
    finally:
        counting.close()
    return str(target), counting.count


def scan(refs: list[ShardRef], spool: Path, endpoint_url: str | None = None,
         on_shard: Callable[[int], None] | None = None) -> tuple[list[str], dict[str, Entry], int]:
    """Read every shard once: (local paths, id -> first Entry, duplicates dropped)."""
    paths: list[str] = []
    kept: dict[str, Entry] = {}
    duplicates = 0
    with ThreadPoolExecutor(DOWNLOAD_THREADS) as pool:
        local = pool.map(lambda item: _materialize(item[1], spool, item[0], endpoint_url), enumerate(refs))
        for number, (ref, (path, stored)) in enumerate(zip(refs, local)):
            if stored != ref.info.bytes:
                raise ExportError(f"shard {ref.location} is {stored:,} bytes but its manifest marker says "
                                  f"{ref.info.bytes:,}: it was changed or truncated after it was written")
            count = 0
            offset = 0
            with open(path, "rb") as f:
                for line in f:
                    length = len(line)
                    if line.strip():
                        count += 1
                        try:
                            key = _key_decoder.decode(line)
                        except msgspec.DecodeError as exc:
                            raise ExportError(f"shard {ref.location} record {count}: {exc}") from None
                        if key.id in kept:
                            duplicates += 1
                        else:
                            kept[key.id] = Entry(key.index, number, offset, length)
                    offset += length
            if count != ref.info.records:
                raise ExportError(f"shard {ref.location} has {count:,} records but its manifest marker says "
                                  f"{ref.info.records:,}")
            paths.append(path)
            if on_shard:
                on_shard(number + 1)
    return paths, kept, duplicates


def ordered(kept: dict[str, Entry], order: str, refs: list[ShardRef]) -> list[Entry]:
    entries = list(kept.values())
    if order == "input":
        entries.sort()  # (index, shard, offset): input order, ties in the order written
    else:
        batch_of = [r.info.batch for r in refs]
        entries.sort(key=lambda e: (batch_of[e.shard], e.offset))
    return entries


def read_records(paths: list[str], entries: Iterable[Entry], open_files: int = 64) -> Iterator[bytes]:
    """The raw lines of the entries, in the given order (a few files kept open)."""
    handles: OrderedDict[int, BinaryIO] = OrderedDict()
    try:
        for entry in entries:
            f = handles.get(entry.shard)
            if f is None:
                if len(handles) >= open_files:
                    handles.popitem(last=False)[1].close()
                f = handles[entry.shard] = open(paths[entry.shard], "rb")
            else:
                handles.move_to_end(entry.shard)
            f.seek(entry.offset)
            line = f.read(entry.length)
            yield line if line.endswith(b"\n") else line + b"\n"
    finally:
        for f in handles.values():
            f.close()


# ------------------------------------------------------------------ writers


def letter_order(letters: list[DeadLetter], order: str) -> list[DeadLetter]:
    if order == "input":
        return sorted(letters, key=lambda d: (d.prompt.index if d.prompt else -1, d.batch, d.id))
    return sorted(letters, key=lambda d: (d.batch, d.prompt.index if d.prompt else -1, d.id))


# ------------------------------------------------------------------ the whole export


def default_file_name(job: str, fmt: str) -> str:
    return job + FORMATS[fmt].file_suffix


def errors_path_for(path: str) -> str:
    """results.jsonl -> results.errors.jsonl (OpenAI Batch errors beside the output)."""
    for suffix in (".jsonl", ".json"):
        if path.endswith(suffix):
            return path[: -len(suffix)] + ".errors.jsonl"
    return path + ".errors.jsonl"


def _atomic_local(path: str, write: Callable[[BinaryIO], Any]) -> tuple[Any, int]:
    """Write through a temporary file in the same folder, then rename: a reader never
    sees half an export. Returns what write returned and the file's size."""
    value = write_atomic(path, write)
    return value, Path(path).stat().st_size


def write_output(dest: str, write: Callable[[BinaryIO], Any], endpoint_url: str | None = None) -> tuple[Any, int]:
    """Write to a local path, or to s3:// through a local temporary file."""
    if not dest.startswith("s3://"):
        return _atomic_local(dest, write)
    from genq.output import s3

    with tempfile.TemporaryDirectory(prefix="genq-export-") as folder:
        local = str(Path(folder) / "upload")
        value, size = _atomic_local(local, write)
        s3.upload_file(local, dest, endpoint_url)
    return value, size


def export(
    *,
    output: str,
    job: str,
    dest: str,
    fmt: str = "jsonl",
    order: str = "input",
    letters: list[DeadLetter] | None = None,
    errors_path: str | None = None,
    endpoint_url: str | None = None,
    dest_endpoint_url: str | None = None,
    incarnation: str | None = None,
) -> ExportSummary:
    """Merge the job's shards under `output` into `dest`. `letters` (the job's dead
    letters) are written to `errors_path` for the openai-batch format."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r} (use {', '.join(FORMATS)})")
    if order not in ORDERS:
        raise ExportError(f"unknown order {order!r} (use {', '.join(ORDERS)})")
    refs = list_shards(output, job, endpoint_url, incarnation)
    summary = ExportSummary(path=dest, shards=len(refs))
    spool_parent = None if dest.startswith("s3://") else Path(dest).resolve().parent
    if spool_parent is not None:
        spool_parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".genq-export-", dir=spool_parent) as spool:
        paths, kept, summary.duplicates = scan(refs, Path(spool), endpoint_url)
        entries = ordered(kept, order, refs)
        writer = FORMATS[fmt].write
        summary.records, summary.bytes = write_output(
            dest, lambda out: writer(read_records(paths, entries), out), dest_endpoint_url)
    if FORMATS[fmt].errors_file:
        errors_path = errors_path or errors_path_for(dest)
        chosen = [d for d in (letters or []) if d.id not in kept]
        summary.skipped_errors = len(letters or []) - len(chosen)
        chosen = letter_order(chosen, order)

        def write_errors(out: BinaryIO) -> int:
            for letter in chosen:
                out.write(_json.encode(openai_error_line(letter)) + b"\n")
            return len(chosen)

        summary.errors, _ = write_output(errors_path, write_errors, dest_endpoint_url)
        summary.errors_path = errors_path
    return summary
