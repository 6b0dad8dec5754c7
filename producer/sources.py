"""Input rows from JSONL (plain or .gz) or Parquet, local or on S3, streamed, each checked by rows.py and named by
its 1-based line or row; a by-reference batch's lines read back against their digest; the enqueue's meter."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import msgspec

from genq.core.records import BatchSource, Endpoint, InputRange, JobConfig, Prompt, Rejected
from genq.output import truth
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


class InputChanged(Exception):
    """A by-reference batch's input lines are not the ones queued (or are gone): the batch is dead-lettered."""


class ColumnMap(NamedTuple):
    """Which Parquet columns carry the request (--messages-column / --prompt-column / --id-column)."""

    messages: str | None = None
    prompt: str | None = None
    id: str | None = None


class Meter:
    """How much of an input is queued (of the rows handed on, not those read ahead), interpolated between the
    reader's marks: bytes parsed, compressed bytes read (.gz) or rows."""

    def __init__(self) -> None:
        self.total, self.unit = 0, "MiB"  # 0: not known; unit: "MiB", "MiB compressed" or "rows"
        self.done = 0  # the reader's count: bytes parsed, or rows read
        self.settled = 0.0  # of total: where the rows handed on end
        self.position: Callable[[], int] = lambda: self.done  # where the reader is, in units of total
        self._marks: deque[tuple[int, int]] = deque([(0, 0)])  # (rows read in all, position after them)

    def of_stream(self, stream: BinaryIO, *, compressed: bool) -> None:
        size = getattr(getattr(stream, "raw", None), "size", None)  # an S3 object: its ContentLength
        try:
            self.total = int(size if size is not None else os.fstat(stream.fileno()).st_size)
        except (OSError, ValueError):
            self.total = 0
        if compressed:
            self.unit, self.position = "MiB compressed", lambda: _tell(stream, self.total)

    def of_rows(self, rows: int) -> None:
        self.total, self.unit = rows, "rows"

    def read_upto(self, rows: int, position: int) -> None:
        self._marks.append((rows, position))

    def settle(self, rows: int) -> None:
        """The first `rows` rows read are handed on; the percent never goes back."""
        marks = self._marks
        while len(marks) > 1 and marks[1][0] <= rows:
            marks.popleft()
        (r0, p0), at = marks[0], float(marks[0][1])
        if len(marks) > 1 and rows > r0:
            r1, p1 = marks[1]
            at = p0 + (p1 - p0) * (rows - r0) / (r1 - r0)  # rows of a chunk are about the same size
        self.settled = max(self.settled, at)

    def finish(self) -> None:
        self.settled = float(self.total)  # a .gz or S3 stream's last position may stop short of its size

    def fraction(self) -> float | None:
        return min(1.0, self.settled / self.total) if self.total > 0 else None

    def of_what(self) -> str:
        return f"{self.total:,} rows" if self.unit == "rows" else f"{self.total / 2**20:,.1f} {self.unit}"


def _tell(stream: BinaryIO, end: int) -> int:
    """The compressed bytes a stream has given; `end` once it is closed (read to the end) or where it cannot
    tell (a pipe or FIFO: OSError)."""
    try:
        return stream.tell()
    except (OSError, ValueError):
        return end


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def is_parquet(uri: str) -> bool:
    return uri.lower().endswith(PARQUET_SUFFIXES)


def located(uri: str) -> str:
    """The input as every machine names it: an s3:// URI as given, a local path made absolute."""
    return uri if is_s3(uri) else os.path.abspath(uri)


def default_rejects_path(uri: str, output: str, job: str) -> str:
    """OUTPUT/JOB/rejects/NAME.rejects.jsonl for input NAME.jsonl; ./genq-rejects/JOB/... for an s3:// output."""
    name = uri.rsplit("/", 1)[-1]
    for suffix in (".gz", ".jsonl", ".json", *PARQUET_SUFFIXES):
        name = name.removesuffix(suffix)
    filename = f"{name or 'input'}.rejects.jsonl"
    if "://" in output:
        return str(Path("genq-rejects") / job / filename)
    return str(Path(truth.job_root(output, job)) / truth.REJECTS_DIR / filename)


def open_rows(uri: str, *, endpoint: Endpoint, s3_endpoint_url: str | None = None, columns: ColumnMap = ColumnMap(),
              meter: Meter | None = None, job: dict[str, Any] | None = None) -> Iterator[Row | Rejected]:
    """The prompts (or rejects) of INPUT in input order; opening errors (no such file, column) raised here."""
    meter = meter or Meter()
    if is_parquet(uri):
        return _parquet_rows(uri, columns, endpoint, s3_endpoint_url, meter, job)
    if columns != ColumnMap():
        raise SourceError("--messages-column, --prompt-column and --id-column apply to Parquet inputs "
                          f"(*.parquet) only; {uri} is read as JSONL")
    return jsonl_rows(open_lines(uri, s3_endpoint_url=s3_endpoint_url, meter=meter), endpoint, meter, job=job)


def jsonl_rows(lines: Iterable[bytes], endpoint: Endpoint, meter: Meter | None = None,
               first_line: int = 1, job: dict[str, Any] | None = None) -> Iterator[Row | Rejected]:
    """The rows of JSONL lines (newlines included); blank lines are skipped."""
    meter = meter or Meter()
    for line_no, raw in enumerate(lines, start=first_line):
        row = parse_line(line_no, raw, endpoint, meter.done, job)
        meter.done += len(raw)
        if row is not None:
            yield row


def open_lines(uri: str, *, s3_endpoint_url: str | None = None, meter: Meter | None = None) -> Iterator[bytes]:
    """The raw lines of a JSONL input, newline included (.gz decompressed as it streams)."""
    stream, gz = _open(uri, s3_endpoint_url), uri.endswith(".gz")
    if meter is not None:
        meter.of_stream(stream, compressed=gz)
    return _lines(uri, stream, gzip.GzipFile(fileobj=stream, mode="rb") if gz else stream)


def _lines(uri: str, stream: BinaryIO, reader: BinaryIO | gzip.GzipFile) -> Iterator[bytes]:
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


def _columns(columns: ColumnMap, names: list[str], uri: str) -> dict[str, str]:
    """Request field ("messages" / "prompt" / "id") -> the Parquet column that carries it."""
    listing = ", ".join(names) or "none"
    for option, name in zip(("--messages-column", "--prompt-column", "--id-column"), columns):
        if name is not None and name not in names:
            raise SourceError(f"{option} {name!r}: no such column in {uri} (columns: {listing})")
    if columns.messages and columns.prompt:
        raise SourceError("give --messages-column or --prompt-column, not both")
    field = "messages" if columns.messages or (not columns.prompt and "messages" in names) else "prompt"
    column = getattr(columns, field) or (field if field in names else None)
    if column is None and not {"custom_id", "body"} <= set(names):  # OpenAI Batch rows go through as they are
        raise SourceError(f"{uri} has no 'messages' or 'prompt' column (columns: {listing}); "
                          "name the one to use with --messages-column or --prompt-column")
    mapping = {field: column} if column else {}
    if columns.id or "id" in names:
        mapping["id"] = columns.id or "id"
    return mapping


def _parquet_rows(uri: str, columns: ColumnMap, endpoint: Endpoint, s3_endpoint_url: str | None,
                  meter: Meter, job: dict[str, Any] | None) -> Iterator[Row | Rejected]:
    """Every column but the request's is metadata, as a JSONL line's extra fields are."""
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
    sources = set(mapping.values())
    aside = [n for n in _REQUEST_COLUMNS if n in parquet.schema_arrow.names and n not in sources]  # metadata

    def records() -> Iterator[Row | Rejected]:
        try:
            for record_batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
                for record in record_batch.to_pylist():
                    meter.done += 1
                    row = {k: v for k, v in record.items() if k not in sources and k not in _REQUEST_COLUMNS}
                    row.update((field, record[column]) for field, column in mapping.items())
                    yield _parquet_row(meter.done, row, {k: record[k] for k in aside}, endpoint, job)
        except (pa.ArrowException, OSError) as exc:
            raise SourceError(f"reading Parquet failed after row {meter.done:,}: {exc}") from None
        finally:
            stream.close()

    return records()


def _parquet_row(row_no: int, row: dict[str, Any], aside: dict[str, Any], endpoint: Endpoint,
                 job: dict[str, Any] | None) -> Row | Rejected:
    try:
        messages = row.get("messages")
        if isinstance(messages, str):
            try:
                row["messages"] = json_decoder.decode(messages)
            except msgspec.DecodeError as exc:
                raise RowError(f"'messages' is a string but not JSON: {exc}") from None
        elif messages is not None:
            row["messages"] = _strip_nulls(messages)
        for field in ("sampling", "body"):  # a row's absent fields are nulls there too: not what it set
            if isinstance(row.get(field), dict):
                row[field] = _strip_nulls(row[field])
        if row.get("id") is None:
            row.pop("id", None)  # a null id: the content hash is used, as for a JSONL line without one
        prompt, converted, model = to_prompt(row_no, row, endpoint, job)
    except RowError as exc:
        return rejected(row_no, str(exc), lenient_encoder.encode(row))
    prompt.metadata = {**(prompt.metadata or {}), **aside}
    return Row(prompt, row, claim_digest(prompt), converted, model=model)


def _strip_nulls(value: Any) -> Any:
    """Drop the None fields Parquet's struct unification adds (a message's missing "name")."""
    if isinstance(value, dict):
        return {k: _strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_nulls(v) for v in value]
    return value


def range_digest(rows: Iterable[Row]) -> str:
    """Digest of (1-based line number, stripped line) of each row of a batch, in input order."""
    items = [b"%d\0%b\n" % (row.prompt.index + 1, row.source) for row in rows if isinstance(row.source, bytes)]
    return hashlib.blake2b(b"".join(items), digest_size=16).hexdigest()


def read_prompts(source: BatchSource, config: JobConfig) -> list[Prompt]:
    """The batch's prompts: inline ones decompressed, by-reference ones read back and parsed as enqueue did."""
    if (ref := source.ref) is None:
        return source.inline_prompts()
    wanted, rows = set(source.prompt_ids()), []
    lines = io.BytesIO(_read_range(ref, config.s3_endpoint_url))  # as enqueue read them: on \n only
    for row in jsonl_rows(lines, config.endpoint, first_line=ref.first_line, job=config.extra_body):
        if isinstance(row, Row) and row.prompt.id in wanted:
            wanted.discard(row.prompt.id)  # the first line with an id is the one queued
            rows.append(row)
    if len(rows) != source.count or range_digest(rows) != ref.digest:
        raise InputChanged(f"input {_describe(ref)} changed since it was queued (digest or line count "
                           f"differs: {len(rows):,} of the batch's {source.count:,} prompts found); "
                           "nothing was generated from it")
    return [row.prompt for row in rows]


def _describe(ref: InputRange) -> str:
    return f"{ref.uri} lines {ref.first_line:,}-{ref.last_line:,} (bytes {ref.start:,}-{ref.end:,})"


def _read_range(ref: InputRange, endpoint_url: str | None) -> bytes:
    want = ref.end - ref.start
    if is_s3(ref.uri):
        from genq.output import s3

        try:
            data = s3.read_object(ref.uri, endpoint_url, (ref.start, ref.end))
        except Exception as exc:
            if s3.error_code(exc) not in (*s3.MISSING, "NoSuchBucket", "InvalidRange", "416"):
                raise
            raise InputChanged(f"input {_describe(ref)} is gone: {s3.describe(exc, ref.uri)}") from None
    else:
        try:
            with open(ref.uri, "rb") as f:
                f.seek(ref.start)
                data = f.read(want)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise InputChanged(f"input {_describe(ref)} is gone: {exc}") from None
    if len(data) != want:
        raise InputChanged(f"input {_describe(ref)} changed: only {len(data):,} of {want:,} bytes are left")
    return data
