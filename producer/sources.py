"""Input rows from JSONL (plain or .gz) or Parquet, local or on S3, streamed (never read whole) and
each checked by rows.py; a bad row is named by its 1-based line or row. Parquet's request is in the
columns --messages-column / --prompt-column / --id-column name (default: "messages", "prompt", "id");
every other column is metadata, as a JSONL line's extra fields are."""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from genq.core.records import Endpoint, Rejected
from genq.output import truth
from genq.producer.meter import Meter
from genq.producer.rows import (
    Row,
    RowError,
    claim_digest,
    json_decoder,
    lenient_encoder,
    parse_line,
    rejected,
    to_prompt,
)

PARQUET_SUFFIXES = (".parquet", ".pq")
PARQUET_BATCH_ROWS = 1024
_REQUEST_COLUMNS = ("messages", "prompt", "id")


class SourceError(Exception):
    pass


@dataclass(frozen=True)
class ColumnMap:
    """Which Parquet columns carry the request (--messages-column / --prompt-column / --id-column)."""

    messages: str | None = None
    prompt: str | None = None
    id: str | None = None


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def is_parquet(uri: str) -> bool:
    return uri.lower().endswith(PARQUET_SUFFIXES)


def open_rows(uri: str, *, endpoint: Endpoint, s3_endpoint_url: str | None = None, columns: ColumnMap = ColumnMap(),
              meter: Meter | None = None) -> Iterator[Row | Rejected]:
    """The prompts (or rejects) of INPUT for a job of `endpoint`, in input order; `meter` is kept up to
    date with how much of it is read. Opening errors (no such file, bucket or column) are raised here."""
    meter = meter or Meter()
    if is_parquet(uri):
        return _parquet_rows(uri, columns, endpoint, s3_endpoint_url, meter)
    if columns != ColumnMap():
        raise SourceError("--messages-column, --prompt-column and --id-column apply to Parquet inputs "
                          f"(*.parquet) only; {uri} is read as JSONL")
    return jsonl_rows(open_lines(uri, s3_endpoint_url=s3_endpoint_url, meter=meter), endpoint, meter)


def jsonl_rows(lines: Iterable[bytes], endpoint: Endpoint, meter: Meter | None = None,
               first_line: int = 1) -> Iterator[Row | Rejected]:
    """The rows of JSONL lines (newlines included); blank lines are skipped."""
    meter = meter or Meter()
    for line_no, raw in enumerate(lines, start=first_line):
        row = parse_line(line_no, raw, endpoint, meter.done)
        meter.done += len(raw)
        if row is not None:
            yield row


def open_lines(uri: str, *, s3_endpoint_url: str | None = None, meter: Meter | None = None) -> Iterator[bytes]:
    """The raw lines of a JSONL input, newline included (.gz decompressed as it streams)."""
    stream = _open(uri, s3_endpoint_url)
    gz = uri.endswith(".gz")
    if meter is not None:
        meter.of_stream(stream, compressed=gz)
    return _lines(uri, stream, gz)


def _lines(uri: str, stream: BinaryIO, gz: bool) -> Iterator[bytes]:
    reader = gzip.GzipFile(fileobj=stream, mode="rb") if gz else stream
    with stream, reader:
        try:
            yield from reader
        except (gzip.BadGzipFile, EOFError, OSError) as exc:
            raise SourceError(f"input {uri} is not readable: {exc}") from None
        except Exception as exc:
            from genq.output import s3  # an S3 input: boto3 is loaded

            if not s3.is_s3_error(exc):
                raise
            if s3.error_code(exc) in s3.CHANGED:
                raise SourceError(f"input {uri} changed while it was being read; enqueue it again "
                                  "(ids already queued are skipped)") from None
            raise SourceError(f"reading input {s3.describe(exc, uri)}") from None


def _open(uri: str, s3_endpoint_url: str | None, seekable: bool = False) -> BinaryIO:
    """A local file or an S3 object as a binary stream; errors name the input."""
    if is_s3(uri):
        from genq.output import s3  # boto3 only when an input is on S3

        try:
            return s3.open_stream(uri, s3_endpoint_url, seekable=seekable)
        except Exception as exc:  # no such key/bucket, access denied, endpoint down
            raise SourceError(f"cannot read input {s3.describe(exc, uri)}") from None
    if "://" in uri:
        raise SourceError(f"unsupported input {uri!r}: use a local path or s3://bucket/key")
    if not os.path.exists(uri):
        raise SourceError(f"input file not found: {uri}")
    if os.path.isdir(uri):
        raise SourceError(f"input is a directory, expected a file: {uri}")
    return open(uri, "rb")


def located(uri: str) -> str:
    """The input as every machine names it: an s3:// URI as given, a local path made absolute."""
    return uri if is_s3(uri) else os.path.abspath(uri)


def default_rejects_path(uri: str, output: str, job: str) -> str:
    """OUTPUT/JOB/rejects/NAME.rejects.jsonl for input NAME.jsonl, never beside the input (its folder
    may be read-only or somebody else's); for an s3:// output, ./genq-rejects/JOB/NAME.rejects.jsonl."""
    name = uri.rsplit("/", 1)[-1]
    for suffix in (".gz", ".jsonl", ".json", *PARQUET_SUFFIXES):
        name = name.removesuffix(suffix)
    filename = f"{name or 'input'}.rejects.jsonl"
    if "://" in output:
        return str(Path("genq-rejects") / job / filename)
    return str(Path(truth.job_root(output, job)) / truth.REJECTS_DIR / filename)


def _columns(columns: ColumnMap, names: list[str], uri: str) -> dict[str, str]:
    """Request field ("messages" / "prompt" / "id") -> the Parquet column that carries it."""
    listing = ", ".join(names) or "none"
    for option, name in (("--messages-column", columns.messages), ("--prompt-column", columns.prompt),
                         ("--id-column", columns.id)):
        if name is not None and name not in names:
            raise SourceError(f"{option} {name!r}: no such column in {uri} (columns: {listing})")
    if columns.messages and columns.prompt:
        raise SourceError("give --messages-column or --prompt-column, not both")
    mapping = {}
    if columns.messages or columns.prompt:
        mapping = {"messages": columns.messages} if columns.messages else {"prompt": str(columns.prompt)}
    elif "messages" in names or "prompt" in names:
        field = "messages" if "messages" in names else "prompt"
        mapping = {field: field}
    elif not {"custom_id", "body"} <= set(names):  # OpenAI Batch rows stored as Parquet go through as they are
        raise SourceError(f"{uri} has no 'messages' or 'prompt' column (columns: {listing}); "
                          "name the one to use with --messages-column or --prompt-column")
    if columns.id or "id" in names:
        mapping["id"] = columns.id or "id"
    return mapping


def _parquet_rows(uri: str, columns: ColumnMap, endpoint: Endpoint, s3_endpoint_url: str | None,
                  meter: Meter) -> Iterator[Row | Rejected]:
    import pyarrow as pa  # only when a Parquet input is read
    import pyarrow.parquet as pq

    stream = _open(uri, s3_endpoint_url, seekable=True)
    try:
        parquet = pq.ParquetFile(stream)
        mapping = _columns(columns, parquet.schema_arrow.names, uri)
    except (pa.ArrowException, OSError, SourceError) as exc:
        stream.close()
        if isinstance(exc, SourceError):
            raise
        raise SourceError(f"{uri} is not a readable Parquet file: {exc}") from None
    meter.of_rows(parquet.metadata.num_rows)  # the footer's count: nothing read yet
    return _parquet_records(parquet, stream, mapping, endpoint, meter)


def _parquet_records(parquet: Any, stream: BinaryIO, mapping: dict[str, str], endpoint: Endpoint,
                     meter: Meter) -> Iterator[Row | Rejected]:
    import pyarrow as pa

    sources = set(mapping.values())
    aside = [n for n in _REQUEST_COLUMNS if n in parquet.schema_arrow.names and n not in sources]  # metadata
    try:
        for record_batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for record in record_batch.to_pylist():
                meter.done += 1
                row = {k: v for k, v in record.items() if k not in sources and k not in _REQUEST_COLUMNS}
                row.update((field, record[column]) for field, column in mapping.items())
                yield _parquet_row(meter.done, row, {k: record[k] for k in aside}, endpoint)
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"reading Parquet failed after row {meter.done:,}: {exc}") from None
    finally:
        stream.close()


def _parquet_row(row_no: int, row: dict[str, Any], aside: dict[str, Any], endpoint: Endpoint) -> Row | Rejected:
    try:
        messages = row.get("messages")
        if isinstance(messages, str):
            try:
                row["messages"] = json_decoder.decode(messages)
            except msgspec.DecodeError as exc:
                raise RowError(f"'messages' is a string but not JSON: {exc}") from None
        elif messages is not None:
            row["messages"] = _strip_nulls(messages)
        if row.get("id") is None:
            row.pop("id", None)  # a null id: the content hash is used, as for a JSONL line without one
        prompt, converted = to_prompt(row_no, row, endpoint)
    except RowError as exc:
        return rejected(row_no, str(exc), lenient_encoder.encode(row))
    prompt.metadata = {**(prompt.metadata or {}), **aside}
    return Row(prompt, row, claim_digest(prompt), converted)


def _strip_nulls(value: Any) -> Any:
    """Drop the None fields Parquet's struct unification adds (a message's missing "name")."""
    if isinstance(value, dict):
        return {k: _strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_nulls(v) for v in value]
    return value
