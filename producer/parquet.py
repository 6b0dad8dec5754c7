"""Parquet inputs (local or s3://): each row becomes a dict handed to genq.producer.rows.

Column mapping: --messages-column COL (a list of {role, content} structs, or a
JSON string of one) or --prompt-column COL (a string) carries the request;
--id-column COL the id (default: a column named "id" if there is one). Without
a mapping, columns named "messages" or "prompt" are used. Every other column is
carried through as metadata, as extra fields of a JSONL line are (a "prompt" or "id"
column that is not the one mapped too). Rows are read
a record batch at a time, so memory stays bounded by one row group.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, BinaryIO

import msgspec

from genq.core.records import Rejected
from genq.producer.files import ColumnMap, SourceError, open_binary
from genq.producer.meter import Meter
from genq.producer.rows import Row, RowError, rejected, row_to_prompt

READ_BATCH_ROWS = 1024
# Request fields of a row (genq.producer.rows): a column with one of these names that is
# not the mapped one would be taken for the request, so it goes into the metadata afterwards.
_REQUEST_NAMES = ("messages", "prompt", "id")

_fallback = msgspec.json.Encoder(enc_hook=str)
_decoder = msgspec.json.Decoder()


def resolve_columns(columns: ColumnMap, names: list[str], uri: str) -> dict[str, str]:
    """target field ("messages" / "prompt" / "id") -> source column name."""
    listing = ", ".join(names) or "none"
    for option, name in (("--messages-column", columns.messages), ("--prompt-column", columns.prompt),
                         ("--id-column", columns.id)):
        if name is not None and name not in names:
            raise SourceError(f"{option} {name!r}: no such column in {uri} (columns: {listing})")
    if columns.messages and columns.prompt:
        raise SourceError("give --messages-column or --prompt-column, not both")
    mapping: dict[str, str] = {}
    if columns.messages:
        mapping["messages"] = columns.messages
    elif columns.prompt:
        mapping["prompt"] = columns.prompt
    elif "messages" in names:
        mapping["messages"] = "messages"
    elif "prompt" in names:
        mapping["prompt"] = "prompt"
    elif not {"custom_id", "body"} <= set(names):  # OpenAI Batch rows stored as Parquet go through as they are
        raise SourceError(f"{uri} has no 'messages' or 'prompt' column (columns: {listing}); "
                          "name the one to use with --messages-column or --prompt-column")
    if columns.id:
        mapping["id"] = columns.id
    elif "id" in names:
        mapping["id"] = "id"
    return mapping


def parquet_rows(uri: str, columns: ColumnMap, *, s3_endpoint_url: str | None = None,
                 meter: Meter | None = None) -> Iterator[Row | Rejected]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    stream = open_binary(uri, s3_endpoint_url=s3_endpoint_url, seekable=True)
    try:
        parquet = pq.ParquetFile(stream)
    except (pa.ArrowException, OSError) as exc:
        stream.close()
        raise SourceError(f"{uri} is not a readable Parquet file: {exc}") from None
    names = parquet.schema_arrow.names
    try:
        mapping = resolve_columns(columns, names, uri)
    except SourceError:
        stream.close()
        raise
    meter = meter or Meter()
    meter.of_rows(parquet.metadata.num_rows)  # the footer's count: nothing read yet
    return _rows(parquet, stream, mapping, meter)


def _rows(parquet: Any, stream: BinaryIO, mapping: dict[str, str], meter: Meter) -> Iterator[Row | Rejected]:
    import pyarrow as pa

    sources = set(mapping.values())
    dropped = {n for n in _REQUEST_NAMES if n not in mapping}  # e.g. a "prompt" column beside --messages-column
    row_no = 0
    try:
        for record_batch in parquet.iter_batches(batch_size=READ_BATCH_ROWS):
            for record in record_batch.to_pylist():
                row_no += 1
                meter.done = row_no
                row = {k: v for k, v in record.items() if k not in sources and k not in dropped and k not in mapping}
                for target, source in mapping.items():
                    row[target] = record[source]
                yield _to_prompt(row_no, row, {k: record[k] for k in dropped if k in record and k not in sources})
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"reading Parquet failed after row {row_no:,}: {exc}") from None
    finally:
        stream.close()


def _to_prompt(row_no: int, row: dict[str, Any], aside: dict[str, Any]) -> Row | Rejected:
    """aside: columns named like a request field but not the mapped one (a "prompt" column
    beside the messages): metadata, as every other column is, never taken for the request."""
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
        prompt = row_to_prompt(row_no, row)
        prompt.metadata = {**(prompt.metadata or {}), **aside}
        return Row(prompt, row)
    except RowError as exc:
        return rejected(row_no, str(exc), _fallback.encode(row))


def _strip_nulls(value: Any) -> Any:
    """Drop the None fields Parquet's struct unification adds (a message's missing "name")."""
    if isinstance(value, dict):
        return {k: _strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_nulls(v) for v in value]
    return value
