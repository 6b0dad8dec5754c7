"""Where input rows come from: JSONL (plain or .gz) and Parquet, local or on S3, each read by one
reader whose rows go through genq.producer.rows; a bad row is reported with its 1-based line (JSONL)
or row (Parquet) number. Nothing is read whole: JSONL streams line by line, S3 objects stream
(resuming after a broken connection), Parquet is read a record batch at a time.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from genq.core.records import Endpoint, Rejected
from genq.output import layout
from genq.producer.files import ColumnMap, SourceError, open_binary
from genq.producer.meter import Meter
from genq.producer.rows import Row, parse_line

PARQUET_SUFFIXES = (".parquet", ".pq")
REJECTS_DIR = "rejects"  # OUTPUT/JOB/rejects/: beside shards/ and manifest/

def is_parquet(uri: str) -> bool:
    return uri.lower().endswith(PARQUET_SUFFIXES)


def open_rows(uri: str, *, endpoint: Endpoint, s3_endpoint_url: str | None = None, columns: ColumnMap = ColumnMap(),
              meter: Meter | None = None) -> Iterator[Row | Rejected]:
    """The prompts (or rejects) of INPUT for a job of `endpoint`, in input order; `meter` is kept up to
    date with how much of it is read. Opening errors (no such file, bucket or column) are raised here."""
    meter = meter or Meter()
    if is_parquet(uri):
        from genq.producer.parquet import parquet_rows  # pyarrow only when a Parquet input is read

        return parquet_rows(uri, columns, endpoint, s3_endpoint_url=s3_endpoint_url, meter=meter)
    if columns.given():
        raise SourceError("--messages-column, --prompt-column and --id-column apply to Parquet inputs "
                          f"(*.parquet) only; {uri} is read as JSONL")
    return jsonl_rows(open_lines(uri, s3_endpoint_url=s3_endpoint_url, meter=meter), endpoint, meter)


def jsonl_rows(lines: Iterable[bytes], endpoint: Endpoint, meter: Meter | None = None) -> Iterator[Row | Rejected]:
    """The rows of JSONL lines (newlines included); blank lines are skipped."""
    meter = meter or Meter()
    offset = 0
    for line_no, raw in enumerate(lines, start=1):
        row = parse_line(line_no, raw, endpoint, offset)
        offset += len(raw)
        meter.done = offset
        if row is not None:
            yield row


def open_lines(uri: str, *, s3_endpoint_url: str | None = None, meter: Meter | None = None) -> Iterator[bytes]:
    """The raw lines of a JSONL input, newline included (.gz decompressed as it streams)."""
    stream = open_binary(uri, s3_endpoint_url=s3_endpoint_url)
    gz = uri.endswith(".gz")
    if meter is not None:
        meter.of_stream(stream, compressed=gz)
    return _lines(uri, stream, gz)


def _lines(uri: str, stream: BinaryIO, gz: bool) -> Iterator[bytes]:
    with stream:
        reader: BinaryIO = gzip.GzipFile(fileobj=stream, mode="rb") if gz else stream  # type: ignore[assignment]
        try:
            yield from reader
        except (gzip.BadGzipFile, EOFError, OSError) as exc:
            raise SourceError(f"input {uri} is not readable: {exc}") from None
        except Exception as exc:
            if not type(exc).__module__.startswith("botocore"):
                raise
            from genq.output import s3

            if s3.error_code(exc) in ("PreconditionFailed", "412"):
                raise SourceError(f"input {uri} changed while it was being read; enqueue it again "
                                  "(ids already queued are skipped)") from None
            raise SourceError(f"reading input {s3.describe(exc, uri)}") from None
        finally:
            if reader is not stream:
                reader.close()


def default_rejects_path(uri: str, output: str, job: str) -> str:
    """OUTPUT/JOB/rejects/NAME.rejects.jsonl for input NAME.jsonl, never beside the input (its folder
    may be read-only or somebody else's); for an s3:// output, ./genq-rejects/JOB/NAME.rejects.jsonl."""
    name = uri.rsplit("/", 1)[-1]
    for suffix in (".gz", ".jsonl", ".json", ".parquet", ".pq"):
        name = name.removesuffix(suffix)
    filename = f"{name or 'input'}.rejects.jsonl"
    if "://" in output:
        return str(Path("genq-rejects") / job / filename)
    return str(Path(layout.job_root(output, job)) / REJECTS_DIR / filename)
