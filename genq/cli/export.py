"""`genq export`: the shards the job's manifest names, each checked against its marker, merged into one JSONL,
Parquet or OpenAI Batch file; a prompt's first result wins. Each shard is read once, spooled beside the file."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import sys
import tempfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import click
import msgspec
import redis

from genq.cli import EXIT_PARTLY_DONE, JobName, local_or_s3, redis_conn, redis_url
from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger import letters as ledger_letters
from genq.core.queueing import load_batch, load_config
from genq.core.records import Choice, DeadLetter, JobConfig, Prompt, Result, ShardInfo
from genq.core.redisconn import mask_url
from genq.core.words import plural
from genq.ops.dlq import failed_batches
from genq.output import truth
from genq.output.truth import MANIFEST_DIR, SHARDS_DIR, LocalStore, Store, batch_of_marker, open_store, write_atomic
from genq.producer.sources import located, read_prompts

DOWNLOAD_THREADS = 8
OPEN_FILES = 64  # spooled shards kept open while the records are copied out
PARQUET_ROWS_PER_GROUP = 5000

_json = msgspec.json.Encoder()
_result_decoder = msgspec.json.Decoder(Result)


class _Key(msgspec.Struct):  # what the first pass decodes of each record: the rest is skipped unparsed
    id: str
    index: int


_key_decoder = msgspec.json.Decoder(_Key)


@click.command(short_help="Merge a job's shards into one JSONL, Parquet or Batch file.")
@click.option("--job", type=JobName(), required=True, help="The job to export.")
@click.option("--to", "dest", required=True, metavar="FILE|DIR", callback=local_or_s3,
              help="Output file (local or s3://bucket/key), or a directory to write JOB.<format> into.")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "parquet", "openai-batch"]), default=None,
              help="jsonl (Result lines, as in the shards), parquet, or openai-batch (OpenAI Batch "
                   "output lines; dead letters go to an errors file). [default: from --to's suffix, else jsonl]")
@click.option("--order", type=click.Choice(["input", "batch"]), default="input", show_default=True,
              help="input: sorted by the prompt's position in the input; batch: shard by shard.")
@click.option("--errors", "errors_path", default=None, metavar="FILE", callback=local_or_s3,
              help="openai-batch: where dead letters go. [default: FILE with .errors.jsonl]")
@click.option("--from", "source_named_from", default=None, hidden=True)  # --output's first name (docs/recovery.md)
@click.option("--output", "source", default=None, metavar="OUTPUT", callback=local_or_s3,
              help="Read shards from OUTPUT (a directory or s3://bucket/prefix, as enqueue's --output) instead "
                   "of the job's configured output, e.g. after copying it.")
@click.option("--s3-endpoint-url", default=None, metavar="URL",
              help="S3-compatible endpoint for reading and writing. [default: the job's, or the AWS env/config]")
@click.pass_context
def export(ctx: click.Context, job: str, dest: str, fmt: str | None, order: str, errors_path: str | None,
           source: str | None, source_named_from: str | None, s3_endpoint_url: str | None) -> None:
    """Merge JOB's finished shards into one JSONL, Parquet or OpenAI Batch file.

    Only shards named by the manifest (JOB/manifest/*.json) are read, each checked against its
    marker; records are deduplicated by id and, with --order input, sorted by their line in the
    input. Exit status 3 (partly done) when some batches' shards are not written yet.

    \b
    Examples:
      genq export --job expansion --to expansion.jsonl
      genq export --job expansion --to ./exports/ --format parquet
      genq export --job batch1 --to out.jsonl --format openai-batch   # + out.errors.jsonl
    """
    conn, source = redis_conn(ctx), source or source_named_from
    config = load_config(conn, job)
    if config is None and source is None:
        raise click.ClickException(f"no job named {job!r} in Redis at {mask_url(redis_url(ctx))}; "
                                   "give --output OUTPUT to export shards without it")
    output = source or config.output  # type: ignore[union-attr]
    endpoint = s3_endpoint_url or (config.s3_endpoint_url if config else None)
    fmt = fmt or ("parquet" if dest.endswith((".parquet", ".pq")) else "jsonl")
    if dest.endswith("/") or (not dest.startswith("s3://") and Path(dest).is_dir()):
        dest = dest.rstrip("/") + "/" + job + FORMATS[fmt][1]
    batch_api = fmt == "openai-batch"
    # Counted before the manifest is listed: a batch is marked done only after its marker is written, so
    # every batch done now is in the export, and one written while it runs makes it partly done.
    status = ledger_jobs.counts(conn, job) if config is not None else None
    try:
        records, errors = run_export(output, job, dest, fmt, order, _letters(conn, job, config) if batch_api else [],
                                     errors_path, endpoint, config.incarnation if config and not source else None)
    except OSError as exc:  # an output or --to that is not what it should be (a file, a folder not writable)
        raise click.ClickException(f"{exc.strerror or exc}: {exc.filename or output}") from None
    except Exception as exc:
        if type(exc).__module__.startswith(("botocore", "boto3")):
            from genq.output import s3

            raise click.ClickException(f"S3: {s3.describe(exc, output)}") from None
        raise
    if status is None:
        return
    if partly := status.done < status.batches_total:
        click.echo(f"  note: job has {plural(status.batches_total, 'batch', 'batches')}, {status.done:,} with shards "
                   f"written: the rest are not in this export yet (exit {EXIT_PARTLY_DONE}: partly done)", err=True)
    if status.dead and not batch_api:
        click.echo(f"  note: {status.dead:,} prompts are in the dead-letter queue, not in this export "
                   "(see `genq dlq`)", err=True)
    if batch_api and (missing := status.total - records - errors) > 0:
        click.echo(f"  note: {missing:,} of {status.total:,} prompts are in neither file (not finished yet)", err=True)
    if partly:
        sys.exit(EXIT_PARTLY_DONE)


def _inside(path: str, folder: str) -> bool:
    if "://" in path or "://" in folder:
        return path.startswith(folder + "/")
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def _letters(conn: redis.Redis, job: str, config: JobConfig | None) -> list[DeadLetter]:
    """The job's dead letters, and the unfinished prompts of batches RQ gave up on: every input id lands
    in the output or the errors file."""
    letters = ledger_letters.read_all(conn, job, DeadLetter)
    dead = {d.id for d in letters}
    for entry in failed_batches(conn, [job]):
        if (batch := load_batch(conn, job, entry.batch)) is None:
            continue
        done = ledger_jobs.result_ids(conn, job, entry.batch)
        try:
            prompts: dict[str, Prompt | None] = {p.id: p for p in read_prompts(batch, config)} if config else {}
        except Exception:  # its input is gone or unreadable: the letters carry the ids alone
            prompts = {}
        letters += [DeadLetter(id=i, job=job, batch=entry.batch, attempts=entry.attempts, kind=entry.kind,
                               message=entry.message, worker=entry.worker, at=entry.at, prompt=prompts.get(i))
                    for i in batch.prompt_ids() if i not in dead and i not in done]
    return letters


def run_export(output: str, job: str, dest: str, fmt: str, order: str, letters: list[DeadLetter],
               errors_path: str | None, endpoint_url: str | None, incarnation: str | None) -> tuple[int, int]:
    """Merge the job's shards (with `incarnation`, that life's and those of a genq that wrote none) into
    `dest`, `letters` into openai-batch's errors file, saying so; the records and error lines written."""
    store = open_store(output, endpoint_url)
    folder, record = store.uri(job), truth.read_job(store, job)  # what export reads: never overwritten by it
    if errors_path and located(errors_path) == located(dest):
        raise click.UsageError(f"--errors {errors_path} is --to's file: the error lines would be written over it")
    for option, path in (("--to", dest), ("--errors", errors_path)):
        where = (f"inside the job's output folder {folder}" if path and _inside(path, folder) else
                 "the job's input" if path and record and located(path) in record.inputs else None)
        if where:
            raise click.UsageError(f"{option} {path} is {where}, which export reads: write it elsewhere")
    shards = _shards(store, job, incarnation)
    spool_parent = None if dest.startswith("s3://") else Path(dest).resolve().parent
    if spool_parent is not None:
        spool_parent.mkdir(parents=True, exist_ok=True)
    kept: dict[str, tuple[int, int, int, int]] = {}  # id -> (index, shard, offset, length) of its first record
    records_read, paths = 0, []
    with tempfile.TemporaryDirectory(prefix=".genq-export-", dir=spool_parent) as spool, \
            ThreadPoolExecutor(DOWNLOAD_THREADS) as pool:
        copies = pool.map(lambda n: _spool(store, *shards[n], Path(spool) / f"{n:08d}.jsonl"), range(len(shards)))
        for number, (path, keys) in enumerate(copies):
            paths.append(path)
            records_read += len(keys)
            for id_, line, offset, length in keys:
                kept.setdefault(id_, (line, number, offset, length))
        entries = sorted(kept.values(), key=None if order == "input" else lambda e: (shards[e[1]][0].batch, e[2]))
        records, size = _write(dest, lambda out: FORMATS[fmt][0](_lines(paths, entries), out), endpoint_url)
    click.echo(f"wrote {plural(records, 'record')} ({_size(size)}, {size:,} bytes) to {dest} "
               f"from {plural(len(shards), 'shard')}")
    if duplicates := records_read - len(kept):
        click.echo(f"  dropped {plural(duplicates, 'duplicate record')} (same id in more than one shard; first kept)")
    if fmt != "openai-batch":
        return records, 0

    def key(d: DeadLetter) -> tuple[Any, ...]:
        index = d.prompt.index if d.prompt else -1
        return (index, d.batch, d.id) if order == "input" else (d.batch, index, d.id)

    chosen = sorted((d for d in letters if d.id not in kept), key=key)
    errors_path = errors_path or dest.removesuffix(".jsonl" if dest.endswith(".jsonl") else ".json") + ".errors.jsonl"
    errors, _ = _write(errors_path, lambda out: write_jsonl((_json.encode(openai_error_line(d)) + b"\n"
                                                             for d in chosen), out), endpoint_url)
    click.echo(f"  wrote {plural(errors, 'error line')} to {errors_path}")
    if skipped := len(letters) - len(chosen):
        click.echo(f"  left out {skipped:,} dead letters whose id also has a result")
    return records, errors


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _shards(store: Store, job: str, incarnation: str | None) -> list[tuple[ShardInfo, str]]:
    """(marker, the shard's path in the store) of each marker in the job's manifest, the first written
    first. The shard is looked for beside its marker, not at info.uri: an output copied elsewhere exports."""
    manifest = f"{job}/{MANIFEST_DIR}"
    if not (names := [n for n in store.names(manifest) if batch_of_marker(n)]):
        raise click.ClickException(f"no shards to export: {store.uri(manifest)}/ is empty or missing (no batch of job "
                                   f"{job!r} has finished there yet, or the output is elsewhere: see --output)")
    with ThreadPoolExecutor(DOWNLOAD_THREADS) as pool:
        raws = list(pool.map(lambda n: store.read(f"{manifest}/{n}") or b"", names))
    shards = []
    for name, raw in zip(names, raws):
        try:
            info = msgspec.json.decode(raw, type=ShardInfo)
        except msgspec.DecodeError as exc:
            raise click.ClickException(f"manifest marker {store.uri(f'{manifest}/{name}')} is not a ShardInfo: "
                                       f"{exc}") from None
        if incarnation is None or info.incarnation in ("", incarnation):
            shards.append((info, f"{job}/{SHARDS_DIR}/{info.uri.rstrip('/').rsplit('/', 1)[-1]}"))
    if not shards:
        raise click.ClickException(f"no shards of this life of job {job!r} (incarnation {incarnation}) in "
                                   f"{store.uri(manifest)}/: the markers there are of an earlier job of that name")
    return sorted(shards, key=lambda s: (s[0].at, s[0].batch))


def _spool(store: Store, info: ShardInfo, rel: str, target: Path) -> tuple[str, list[tuple[str, int, int, int]]]:
    """A local, uncompressed copy of the shard (the shard itself when it is one), checked against its
    marker, and the (id, index, offset, length) of its records."""
    uri, unzip, size = store.uri(rel), zlib.decompressobj(wbits=31) if rel.endswith(".gz") else None, 0
    if isinstance(store, LocalStore) and not unzip and Path(uri).is_file():
        path, size = uri, Path(uri).stat().st_size
    else:
        path = str(target)
        try:
            with store.open(rel) as source, open(target, "wb") as out:
                while chunk := source.read(1 << 20):
                    size += len(chunk)
                    out.write(unzip.decompress(chunk) if unzip else chunk)
        except FileNotFoundError:
            raise click.ClickException(f"shard {uri} named by the manifest is missing") from None
        except (OSError, zlib.error) as exc:
            raise click.ClickException(f"shard {uri} is unreadable: {exc}") from None
        except Exception as exc:
            from genq.output import s3  # a store.open of an S3 shard: boto3 is loaded

            if not s3.is_s3_error(exc):
                raise
            raise click.ClickException(f"cannot read shard {s3.describe(exc, uri)}") from None
    if size != info.bytes:
        raise click.ClickException(f"shard {uri} is {size:,} bytes but its manifest marker says "
                                   f"{info.bytes:,}: it was changed or truncated after it was written")
    keys: list[tuple[str, int, int, int]] = []
    offset = 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    key = _key_decoder.decode(line)
                except msgspec.DecodeError as exc:
                    raise click.ClickException(f"shard {uri} record {len(keys) + 1}: {exc}") from None
                keys.append((key.id, key.index, offset, len(line)))
            offset += len(line)
    if len(keys) != info.records:
        raise click.ClickException(f"shard {uri} has {len(keys):,} records but its manifest marker says "
                                   f"{info.records:,}")
    return path, keys


def _lines(paths: list[str], entries: Iterable[tuple[int, int, int, int]]) -> Iterator[bytes]:
    """The raw lines of the entries, in the given order (the OPEN_FILES last used kept open)."""
    handles: OrderedDict[int, BinaryIO] = OrderedDict()
    try:
        for _, shard, offset, length in entries:
            if (f := handles.get(shard)) is None:
                if len(handles) >= OPEN_FILES:
                    handles.popitem(last=False)[1].close()
                f = handles[shard] = open(paths[shard], "rb")
            handles.move_to_end(shard)
            f.seek(offset)
            line = f.read(length)
            yield line if line.endswith(b"\n") else line + b"\n"
    finally:
        for f in handles.values():
            f.close()


def _write(dest: str, write: Callable[[BinaryIO], int], endpoint_url: str | None) -> tuple[int, int]:
    """Write whole (a reader never sees half an export) to a local path, or to s3:// through a local
    temporary file; what `write` returned and the size written. A name ending .gz is gzip, as readers expect."""
    if dest.endswith(".gz"):
        plain = write

        def write(out: BinaryIO) -> int:
            with gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as packed:
                return plain(packed)  # type: ignore[arg-type]
    if not dest.startswith("s3://"):
        return write_atomic(dest, write), Path(dest).stat().st_size
    from genq.output import s3

    with tempfile.TemporaryDirectory(prefix="genq-export-") as folder:
        local = str(Path(folder) / "upload")
        value = write_atomic(local, write)
        bucket, key = s3.parse_uri(dest)
        s3.client(endpoint_url).upload_file(local, bucket, key)  # multipart when large
        return value, Path(local).stat().st_size


# --------------------------------------------------------------------------- the formats
def write_jsonl(lines: Iterable[bytes], out: BinaryIO) -> int:
    count = 0
    for line in lines:
        out.write(line)
        count += 1
    return count


# One fixed schema: a column's name and kind: an Arrow type, "usage" (an int64 of Result.usage), "json"
# (a JSON string: keys differ from row to row), "messages" (a list of {role, content, other}: _message) or
# "choices" (every sample when n > 1; the columns before it are choice 0's).
_CHOICE_COLUMNS = {"index": "int64", "completion": "string", "reasoning_content": "string",
                   "finish_reason": "string", "completion_tokens": "int64", "logprobs": "json",
                   "matched_stop": "json", "tool_calls": "json"}
PARQUET_COLUMNS = {
    "id": "string", "custom_id": "string", "index": "int64", "job": "string", "batch": "string",
    "messages": "messages", "prompt": "string", "completion": "string", "reasoning_content": "string",
    "finish_reason": "string", "prompt_tokens": "usage", "completion_tokens": "usage", "reasoning_tokens": "usage",
    "model": "string", "worker": "string", "attempts": "int32", "latency_s": "float64", "response_id": "string",
    "finished_at": "float64", "settings_version": "int32", "metadata": "json", "sampling": "json",
    "choices": "choices", "logprobs": "json", "matched_stop": "json", "tool_calls": "json",
}


def _cells(obj: Result | Choice, columns: dict[str, str]) -> dict[str, Any]:
    row = {}
    for name, kind in columns.items():
        value = getattr(obj.usage if kind == "usage" and isinstance(obj, Result) else obj, name)
        if kind == "json":  # matched_stop: "null" when stop was set and the server named nothing, null when not set
            absent = msgspec.UNSET if name == "matched_stop" else None
            value = None if value is absent or (name == "metadata" and not value) else _json.encode(value).decode()
        elif kind == "messages" and value is not None:
            value = [_message(m) for m in value]
        elif kind == "choices" and value is not None:
            value = [_cells(c, _CHOICE_COLUMNS) for c in value]
        row[name] = value
    return row


def _message(m: dict[str, Any]) -> dict[str, Any]:
    """Parquet's message: non-string content (multimodal parts) and the other keys (tool_calls, name...) as JSON."""
    content, rest = m.get("content"), {k: v for k, v in m.items() if k not in ("role", "content")}
    return {"role": m.get("role"), "content": content if content is None or isinstance(content, str) else
            _json.encode(content).decode(), "other": _json.encode(rest).decode() if rest else None}


def parquet_schema() -> Any:
    import pyarrow as pa

    def arrow(kind: str) -> Any:
        if kind == "messages":
            return pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("other", pa.string())]))
        if kind == "choices":
            return pa.list_(pa.struct([(name, arrow(k)) for name, k in _CHOICE_COLUMNS.items()]))
        return getattr(pa, {"json": "string", "usage": "int64"}.get(kind, kind))()

    return pa.schema([(name, arrow(kind)) for name, kind in PARQUET_COLUMNS.items()])


def write_parquet(lines: Iterable[bytes], out: BinaryIO) -> int:
    """Row groups of PARQUET_ROWS_PER_GROUP rows, zstd-compressed, one schema (PARQUET_COLUMNS)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema, count = parquet_schema(), 0
    decoded = (_cells(_result_decoder.decode(line), PARQUET_COLUMNS) for line in lines)
    with pq.ParquetWriter(out, schema, compression="zstd") as writer:  # an empty export: the schema alone
        while rows := list(itertools.islice(decoded, PARQUET_ROWS_PER_GROUP)):
            writer.write_table(pa.Table.from_pylist(rows, schema=schema))
            count += len(rows)
    return count


def write_openai_batch(lines: Iterable[bytes], out: BinaryIO) -> int:
    return write_jsonl((_json.encode(openai_output_line(_result_decoder.decode(line))) + b"\n" for line in lines), out)


# name -> (writer, the file name `--to DIR/` gives it)
FORMATS: dict[str, tuple[Callable[[Iterable[bytes], BinaryIO], int], str]] = {
    "jsonl": (write_jsonl, ".jsonl"), "parquet": (write_parquet, ".parquet"),
    "openai-batch": (write_openai_batch, ".batch_output.jsonl")}


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
                                   matched_stop=r.matched_stop, tool_calls=r.tool_calls)]

    def said(c: Choice) -> dict[str, Any]:
        if completions:
            return {"text": c.completion}
        return {"message": {"role": "assistant", "content": c.completion, "reasoning_content": c.reasoning_content,
                            **({"tool_calls": c.tool_calls} if c.tool_calls else {})}}

    choices = [{"index": c.index, **said(c), "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                **({} if c.matched_stop is msgspec.UNSET else {"matched_stop": c.matched_stop})} for c in samples]
    body = {"id": r.response_id or (f"cmpl-{h}" if completions else f"chatcmpl-{h}"),
            "object": "text_completion" if completions else "chat.completion", "created": int(r.finished_at),
            "model": r.model, "choices": choices, "usage": usage}
    return {"id": f"batch_req_{h}", "custom_id": r.custom_id or r.id,
            "response": {"status_code": 200, "request_id": r.response_id or f"req_{h}", "body": body}, "error": None}


def openai_error_line(letter: DeadLetter) -> dict[str, Any]:
    """One line of an OpenAI Batch error file for a dead letter."""
    h = _hash(letter.job, letter.id)
    custom_id = (letter.prompt.custom_id if letter.prompt else None) or letter.id
    # An error event inside a 200 stream: the server failed the request.
    status = 500 if letter.status is None and letter.kind == "server_error" else letter.status
    if status is None:  # no HTTP answer to report: OpenAI's "non-HTTP error" shape
        return {"id": f"batch_req_{h}", "custom_id": custom_id, "response": None,
                "error": {"code": letter.kind, "message": letter.message}}
    error = {"message": letter.message, "type": "invalid_request_error" if 400 <= status < 500 else "server_error",
             "param": None, "code": letter.kind}
    return {"id": f"batch_req_{h}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"req_{h}", "body": {"error": error}}, "error": None}
