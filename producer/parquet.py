"""Parquet inputs (local or s3://), read a record batch at a time: each row becomes the dict a JSONL
line would decode to, checked by genq.producer.rows.

--messages-column COL (a list of {role, content} structs, or a JSON string of one) or --prompt-column
COL carries the request, --id-column COL the id; without them, columns named "messages", "prompt" and
"id" do. Every other column is metadata, as extra fields of a JSONL line are, and so is a "messages",
"prompt" or "id" column that is not the mapped one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, BinaryIO

import msgspec

from genq.core.records import Endpoint, Rejected
from genq.producer.files import ColumnMap, SourceError, open_binary
from genq.producer.meter import Meter
from genq.producer.rows import Row, RowError, claim_digest, rejected, to_prompt

READ_BATCH_ROWS = 1024
_REQUEST_NAMES = ("messages", "prompt", "id")

_fallback = msgspec.json.Encoder(enc_hook=str)
_decoder = msgspec.json.Decoder()


def resolve_columns(columns: ColumnMap, names: list[str], uri: str) -> dict[str, str]:
    """Request field ("messages" / "prompt" / "id") -> the column that carries it."""
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


def parquet_rows(uri: str, columns: ColumnMap, endpoint: Endpoint, *, s3_endpoint_url: str | None = None,
                 meter: Meter | None = None) -> Iterator[Row | Rejected]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    stream = open_binary(uri, s3_endpoint_url=s3_endpoint_url, seekable=True)
    try:
        parquet = pq.ParquetFile(stream)
        mapping = resolve_columns(columns, parquet.schema_arrow.names, uri)
    except (pa.ArrowException, OSError) as exc:
        stream.close()
        raise SourceError(f"{uri} is not a readable Parquet file: {exc}") from None
    except SourceError:
        stream.close()
        raise
    meter = meter or Meter()
    meter.of_rows(parquet.metadata.num_rows)  # the footer's count: nothing read yet
    return _rows(parquet, stream, mapping, endpoint, meter)


def _rows(parquet: Any, stream: BinaryIO, mapping: dict[str, str], endpoint: Endpoint,
          meter: Meter) -> Iterator[Row | Rejected]:
    import pyarrow as pa

    sources = set(mapping.values())
    aside = {n for n in _REQUEST_NAMES if n not in mapping and n not in sources}  # metadata, never the request
    row_no = 0
    try:
        for record_batch in parquet.iter_batches(batch_size=READ_BATCH_ROWS):
            for record in record_batch.to_pylist():
                row_no += 1
                meter.done = row_no
                row = {k: v for k, v in record.items() if k not in sources and k not in aside and k not in mapping}
                row.update((target, record[source]) for target, source in mapping.items())
                yield _row(row_no, row, {k: record[k] for k in aside if k in record}, endpoint)
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"reading Parquet failed after row {row_no:,}: {exc}") from None
    finally:
        stream.close()


def _row(row_no: int, row: dict[str, Any], aside: dict[str, Any], endpoint: Endpoint) -> Row | Rejected:
    try:
        messages = row.get("messages")
        if isinstance(messages, str):
            try:
                row["messages"] = _decoder.decode(messages)
            except msgspec.DecodeError as exc:
                raise RowError(f"'messages' is a string but not JSON: {exc}") from None
        elif messages is not None:
            row["messages"] = _strip_nulls(messages)
        if row.get("id") is None:
            row.pop("id", None)  # a null id: the content hash is used, as for a JSONL line without one
        prompt, converted = to_prompt(row_no, row, endpoint)
    except RowError as exc:
        return rejected(row_no, str(exc), _fallback.encode(row))
    prompt.metadata = {**(prompt.metadata or {}), **aside}
    return Row(prompt, row, claim_digest(prompt), converted)


def _strip_nulls(value: Any) -> Any:
    """Drop the None fields Parquet's struct unification adds (a message's missing "name")."""
    if isinstance(value, dict):
        return {k: _strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_nulls(v) for v in value]
    return value
