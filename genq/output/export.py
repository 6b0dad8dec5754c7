"""Merge a job's finished shards into one file, in one of genq.output.formats.

Only shards named by manifest markers are read (a shard without one may be half written), each
checked against its marker (bytes, records) before anything is exported. Each shard is read once:
S3 and .gz shards are spooled uncompressed beside the destination, and only each record's id, input
index and spool offset are kept. Shards go in the order of their last outcome (ShardInfo.at) and a
repeated id is dropped, so a prompt's first result wins; the rest is sorted and copied out.
"""

from __future__ import annotations

import tempfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

import msgspec

from genq.core.records import DeadLetter, ShardInfo
from genq.output.formats import FORMATS, openai_error_line
from genq.output.truth import MANIFEST_DIR, SHARDS_DIR, LocalStore, Store, batch_of_marker, open_store, write_atomic

ORDERS = ("input", "batch")
DOWNLOAD_THREADS = 8
OPEN_FILES = 64  # spooled shards kept open while the records are copied out

_json = msgspec.json.Encoder()
_info_decoder = msgspec.json.Decoder(ShardInfo)


class ExportError(Exception):
    """Something the operator must look at (a shard that disagrees with its marker...)."""


class _Key(msgspec.Struct):
    """What the first pass decodes of each record: the rest is skipped unparsed."""

    id: str
    index: int


_key_decoder = msgspec.json.Decoder(_Key)


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


def export(*, output: str, job: str, dest: str, fmt: str = "jsonl", order: str = "input",
           letters: list[DeadLetter] | None = None, errors_path: str | None = None, endpoint_url: str | None = None,
           dest_endpoint_url: str | None = None, incarnation: str | None = None) -> ExportSummary:
    """Merge the job's shards under `output` into `dest` (fmt and order as the CLI's choices allow);
    with `incarnation`, only that life's (and those of a genq that wrote none). `letters` (the job's
    dead letters) go to `errors_path` when the format has an errors file."""
    store = open_store(output, endpoint_url)
    shards = _shards(store, job, incarnation)
    summary = ExportSummary(path=dest, shards=len(shards))
    spool_parent = None if dest.startswith("s3://") else Path(dest).resolve().parent
    if spool_parent is not None:
        spool_parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".genq-export-", dir=spool_parent) as spool:
        paths, kept, summary.duplicates = _scan(store, shards, Path(spool))
        entries = list(kept.values())
        if order == "input":
            entries.sort()  # (index, shard, offset): input order, ties in the order written
        else:
            entries.sort(key=lambda e: (shards[e.shard][0].batch, e.offset))
        write = FORMATS[fmt].write
        summary.records, summary.bytes = _write(dest, lambda out: write(_lines(paths, entries), out), dest_endpoint_url)
    if FORMATS[fmt].errors_file:
        chosen = [d for d in letters or [] if d.id not in kept]
        summary.skipped_errors = len(letters or []) - len(chosen)

        def index(d: DeadLetter) -> int:
            return d.prompt.index if d.prompt else -1

        chosen.sort(key=lambda d: (index(d), d.batch, d.id) if order == "input" else (d.batch, index(d), d.id))
        lines = [_json.encode(openai_error_line(d)) + b"\n" for d in chosen]
        summary.errors_path = errors_path or _errors_path(dest)
        summary.errors, _ = _write(summary.errors_path, lambda out: FORMATS["jsonl"].write(lines, out), dest_endpoint_url)
    return summary


def default_file_name(job: str, fmt: str) -> str:
    return job + FORMATS[fmt].file_suffix


def _errors_path(path: str) -> str:
    """results.jsonl -> results.errors.jsonl (OpenAI Batch errors beside the output)."""
    return path.removesuffix(".jsonl" if path.endswith(".jsonl") else ".json") + ".errors.jsonl"


def _shards(store: Store, job: str, incarnation: str | None) -> list[tuple[ShardInfo, str]]:
    """(marker, the shard's path in the store) of each marker in the job's manifest, the first written
    first. The shard is looked for beside its marker, not at info.uri: an output copied elsewhere
    still exports."""
    manifest = f"{job}/{MANIFEST_DIR}"
    names = [n for n in store.names(manifest) if batch_of_marker(n)]
    if not names:
        raise ExportError(f"no shards to export: {store.uri(manifest)}/ is empty or missing (no batch of job "
                          f"{job!r} has finished there yet, or the output is elsewhere: see --from)")
    with ThreadPoolExecutor(DOWNLOAD_THREADS) as pool:
        raws = list(pool.map(lambda n: store.read(f"{manifest}/{n}") or b"", names))
    shards = []
    for name, raw in zip(names, raws):
        try:
            info = _info_decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise ExportError(f"manifest marker {store.uri(f'{manifest}/{name}')} is not a ShardInfo: {exc}") from None
        if incarnation is None or info.incarnation in ("", incarnation):
            shards.append((info, f"{job}/{SHARDS_DIR}/{info.uri.rstrip('/').rsplit('/', 1)[-1]}"))
    if not shards:
        raise ExportError(f"no shards of this life of job {job!r} (incarnation {incarnation}) in "
                          f"{store.uri(manifest)}/: the markers there are of an earlier job of that name")
    return sorted(shards, key=lambda s: (s[0].at, s[0].batch))


def _local_copy(store: Store, rel: str, spool: Path, number: int) -> tuple[str, int]:
    """A local, uncompressed copy of the shard (the shard itself when it is one already), and its
    stored size in bytes."""
    uri, gz = store.uri(rel), rel.endswith(".gz")
    if isinstance(store, LocalStore) and not gz and Path(uri).is_file():
        return uri, Path(uri).stat().st_size
    target, size = spool / f"{number:08d}.jsonl", 0
    unzip = zlib.decompressobj(wbits=31) if gz else None
    try:
        with store.open(rel) as source, open(target, "wb") as out:
            while chunk := source.read(1 << 20):
                size += len(chunk)
                out.write(unzip.decompress(chunk) if unzip else chunk)
    except FileNotFoundError:
        raise ExportError(f"shard {uri} named by the manifest is missing") from None
    except (OSError, zlib.error) as exc:
        raise ExportError(f"shard {uri} is unreadable: {exc}") from None
    except Exception as exc:
        from genq.output import s3  # a store.open of an S3 shard: boto3 is loaded

        if not s3.is_s3_error(exc):
            raise
        raise ExportError(f"cannot read shard {s3.describe(exc, uri)}") from None
    return str(target), size


def _scan(store: Store, shards: list[tuple[ShardInfo, str]], spool: Path) -> tuple[list[str], dict[str, Entry], int]:
    """Read every shard once: (local paths, id -> its first Entry, duplicates dropped)."""
    paths: list[str] = []
    kept: dict[str, Entry] = {}
    duplicates = 0
    with ThreadPoolExecutor(DOWNLOAD_THREADS) as pool:
        copies = pool.map(lambda n: _local_copy(store, shards[n][1], spool, n), range(len(shards)))
        for number, ((info, rel), (path, stored)) in enumerate(zip(shards, copies)):
            uri = store.uri(rel)
            if stored != info.bytes:
                raise ExportError(f"shard {uri} is {stored:,} bytes but its manifest marker says "
                                  f"{info.bytes:,}: it was changed or truncated after it was written")
            count = offset = 0
            with open(path, "rb") as f:
                for line in f:
                    if line.strip():
                        count += 1
                        try:
                            key = _key_decoder.decode(line)
                        except msgspec.DecodeError as exc:
                            raise ExportError(f"shard {uri} record {count}: {exc}") from None
                        if key.id in kept:
                            duplicates += 1
                        else:
                            kept[key.id] = Entry(key.index, number, offset, len(line))
                    offset += len(line)
            if count != info.records:
                raise ExportError(f"shard {uri} has {count:,} records but its manifest marker says {info.records:,}")
            paths.append(path)
    return paths, kept, duplicates


def _lines(paths: list[str], entries: Iterable[Entry]) -> Iterator[bytes]:
    """The raw lines of the entries, in the given order (the OPEN_FILES last used kept open)."""
    handles: OrderedDict[int, BinaryIO] = OrderedDict()
    try:
        for entry in entries:
            f = handles.get(entry.shard)
            if f is None:
                if len(handles) >= OPEN_FILES:
                    handles.popitem(last=False)[1].close()
                f = handles[entry.shard] = open(paths[entry.shard], "rb")
            handles.move_to_end(entry.shard)
            f.seek(entry.offset)
            line = f.read(entry.length)
            yield line if line.endswith(b"\n") else line + b"\n"
    finally:
        for f in handles.values():
            f.close()


def _write(dest: str, write: Callable[[BinaryIO], int], endpoint_url: str | None) -> tuple[int, int]:
    """Write whole (a reader never sees half an export) to a local path, or to s3:// through a local
    temporary file; what `write` returned and the size written."""
    if not dest.startswith("s3://"):
        return write_atomic(dest, write), Path(dest).stat().st_size
    from genq.output import s3

    with tempfile.TemporaryDirectory(prefix="genq-export-") as folder:
        local = str(Path(folder) / "upload")
        value = write_atomic(local, write)
        s3.upload_file(local, dest, endpoint_url)
        return value, Path(local).stat().st_size
