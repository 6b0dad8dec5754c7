"""`genq export`: merge a job's finished shards into one file, as JSONL (as stored), Parquet or OpenAI
Batch output.

Only shards named by manifest markers are read (a shard without one may be half written), each
checked against its marker (bytes, records) before anything is exported. Each shard is read once:
S3 and .gz shards are spooled uncompressed beside the destination, and only each record's id, input
index and spool offset are kept. Shards go in the order of their last outcome (ShardInfo.at) and a
repeated id is dropped, so a prompt's first result wins; the rest is sorted and copied out.

OpenAI Batch output follows OpenAI's batch output and error file lines, as vLLM's run_batch writes
them: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}. A success gets
a chat.completion (or text_completion) body rebuilt from its Result; a dead letter goes to the errors
file with the server's HTTP status and message when it answered, else response null and error
{"code", "message"} (a timeout, a reset).
"""

from __future__ import annotations

import hashlib
import tempfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import msgspec

from genq.core.records import Choice, DeadLetter, Result, ShardInfo
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


# --------------------------------------------------------------------------- the formats
PARQUET_ROWS_PER_GROUP = 5000

_result_decoder = msgspec.json.Decoder(Result)


# One fixed schema, a column's name and kind: an Arrow type, "usage" (an int64 of Result.usage),
# "json" (a JSON string: metadata, logprobs, matched_stop and tool_calls have keys that differ from row
# to row), "messages" (a list of {role, content}, non-string content as its JSON) or "choices" (every
# sample when n > 1; the columns before it are choice 0's). The JSONL export keeps every field as it is.
_CHOICE_COLUMNS = {"index": "int64", "completion": "string", "reasoning_content": "string",
                   "finish_reason": "string", "completion_tokens": "int64", "logprobs": "json",
                   "matched_stop": "json", "tool_calls": "json"}
PARQUET_COLUMNS = {
    "id": "string", "custom_id": "string", "index": "int64", "job": "string", "batch": "string",
    "messages": "messages", "prompt": "string", "completion": "string", "reasoning_content": "string",
    "finish_reason": "string", "prompt_tokens": "usage", "completion_tokens": "usage", "reasoning_tokens": "usage",
    "model": "string", "worker": "string", "attempts": "int32", "latency_s": "float64", "response_id": "string",
    "finished_at": "float64", "metadata": "json", "choices": "choices", "logprobs": "json",
    "matched_stop": "json", "tool_calls": "json",
}


def _cells(obj: Result | Choice, columns: dict[str, str]) -> dict[str, Any]:
    return {name: _cell(obj, name, kind) for name, kind in columns.items()}


def _cell(obj: Any, name: str, kind: str) -> Any:
    if kind == "usage":
        return getattr(obj.usage, name)
    value = getattr(obj, name)
    if kind == "json":  # matched_stop: "null" when stop was set and the server named nothing, null when not set
        absent = msgspec.UNSET if name == "matched_stop" else None
        return None if value is absent or (name == "metadata" and not value) else _json.encode(value).decode()
    if kind == "messages" and value is not None:
        return [{"role": m.get("role"), "content": _text(m.get("content"))} for m in value]
    if kind == "choices" and value is not None:
        return [_cells(c, _CHOICE_COLUMNS) for c in value]
    return value


def _text(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else _json.encode(value).decode()  # multimodal parts


def parquet_schema() -> Any:
    import pyarrow as pa

    def arrow(kind: str) -> Any:
        if kind == "messages":
            return pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
        if kind == "choices":
            return pa.list_(pa.struct([(name, arrow(k)) for name, k in _CHOICE_COLUMNS.items()]))
        return getattr(pa, {"json": "string", "usage": "int64"}.get(kind, kind))()

    return pa.schema([(name, arrow(kind)) for name, kind in PARQUET_COLUMNS.items()])


def write_jsonl(lines: Iterable[bytes], out: BinaryIO) -> int:
    count = 0
    for line in lines:
        out.write(line)
        count += 1
    return count


def write_parquet(lines: Iterable[bytes], out: BinaryIO) -> int:
    """Row groups of PARQUET_ROWS_PER_GROUP rows, zstd-compressed, one schema (PARQUET_COLUMNS)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema, count, rows = parquet_schema(), 0, []
    with pq.ParquetWriter(out, schema, compression="zstd") as writer:
        for line in lines:
            r = _result_decoder.decode(line)
            rows.append(_cells(r, PARQUET_COLUMNS))
            count += 1
            if len(rows) >= PARQUET_ROWS_PER_GROUP:
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                rows = []
        if rows or count == 0:
            writer.write_table(pa.Table.from_pylist(rows, schema=schema))
    return count


def _hash(job: str, prompt_id: str) -> str:
    return hashlib.sha256(f"{job}\0{prompt_id}".encode()).hexdigest()[:24]


def openai_output_line(r: Result) -> dict[str, Any]:
    """One line of an OpenAI Batch output file for a finished prompt."""
    h = _hash(r.job, r.id)
    usage: dict[str, Any] = {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                             "total_tokens": r.usage.prompt_tokens + r.usage.completion_tokens}
    if r.usage.reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": r.usage.reasoning_tokens}
    completions = r.messages is None and r.prompt is not None
    samples = r.choices or [Choice(index=0, completion=r.completion, finish_reason=r.finish_reason,
                                   reasoning_content=r.reasoning_content, logprobs=r.logprobs,
                                   tool_calls=r.tool_calls)]
    choices: list[dict[str, Any]] = []
    for c in samples:
        if completions:
            choices.append({"index": c.index, "text": c.completion, "logprobs": c.logprobs,
                            "finish_reason": c.finish_reason})
            continue
        message: dict[str, Any] = {"role": "assistant", "content": c.completion, "reasoning_content": c.reasoning_content}
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        choices.append({"index": c.index, "message": message, "logprobs": c.logprobs, "finish_reason": c.finish_reason})
    body = {
        "id": r.response_id or (f"cmpl-{h}" if completions else f"chatcmpl-{h}"),
        "object": "text_completion" if completions else "chat.completion",
        "created": int(r.finished_at),
        "model": r.model,
        "choices": choices,
        "usage": usage,
    }
    return {"id": f"batch_req_{h}", "custom_id": r.custom_id or r.id,
            "response": {"status_code": 200, "request_id": r.response_id or f"req_{h}", "body": body}, "error": None}


def openai_error_line(letter: DeadLetter) -> dict[str, Any]:
    """One line of an OpenAI Batch error file for a dead letter."""
    h = _hash(letter.job, letter.id)
    custom_id = (letter.prompt.custom_id if letter.prompt else None) or letter.id
    status = letter.status
    if status is None and letter.kind == "server_error":
        status = 500  # an error event inside a 200 stream: the server failed the request
    if status is None:  # no HTTP answer to report: OpenAI's "non-HTTP error" shape
        return {"id": f"batch_req_{h}", "custom_id": custom_id, "response": None,
                "error": {"code": letter.kind, "message": letter.message}}
    error = {"message": letter.message, "type": "invalid_request_error" if 400 <= status < 500 else "server_error",
             "param": None, "code": letter.kind}
    return {"id": f"batch_req_{h}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"req_{h}", "body": {"error": error}}, "error": None}


def write_openai_batch(lines: Iterable[bytes], out: BinaryIO) -> int:
    return write_jsonl((_json.encode(openai_output_line(_result_decoder.decode(line))) + b"\n" for line in lines), out)


class Format(NamedTuple):
    """An export format: its writer, the file name `genq export --to DIR/` gives it, the suffixes that
    choose it when --format is not given, and whether dead letters go to an errors file beside it."""

    write: Callable[[Iterable[bytes], BinaryIO], int]
    file_suffix: str
    chosen_by: tuple[str, ...] = ()
    errors_file: bool = False


FORMATS: dict[str, Format] = {
    "jsonl": Format(write_jsonl, ".jsonl"),
    "parquet": Format(write_parquet, ".parquet", chosen_by=(".parquet", ".pq")),
    "openai-batch": Format(write_openai_batch, ".batch_output.jsonl", errors_file=True),
}


def format_for(dest: str, asked: str | None) -> str:
    """--format if given, else the one the destination's suffix chooses, else jsonl."""
    return asked or next((name for name, f in FORMATS.items() if dest.endswith(f.chosen_by)), "jsonl")
