"""A batch record becomes prompts here: inline ones decompress; by-reference ones read their byte range
of the input, parse it as enqueue did and check its digest. A line missing, changed or moved raises
InputChanged: the batch is dead-lettered rather than anything sent from the wrong lines."""

from __future__ import annotations

import asyncio
import hashlib
import io
from collections.abc import Iterable

from genq.core.records import BatchSource, InputRange, JobConfig, Prompt
from genq.producer.rows import Row
from genq.producer.sources import is_s3, jsonl_rows


class InputChanged(Exception):
    """The input lines of a by-reference batch are not the ones queued (or are gone)."""


def range_digest(rows: Iterable[Row]) -> str:
    """Digest of (1-based line number, stripped line) of each row of a batch, in input order."""
    items = [b"%d\0%b\n" % (row.prompt.index + 1, row.source) for row in rows if isinstance(row.source, bytes)]
    return hashlib.blake2b(b"".join(items), digest_size=16).hexdigest()


async def load_prompts(source: BatchSource, config: JobConfig) -> list[Prompt]:
    """read_prompts without blocking the event loop. Raises InputChanged (dead-letter the batch) or,
    for a transient failure (S3 unreachable, a disk error), the underlying error (try again later)."""
    return await asyncio.to_thread(read_prompts, source, config)


def read_prompts(source: BatchSource, config: JobConfig) -> list[Prompt]:
    """The batch's prompts, in input order."""
    ref = source.ref
    if ref is None:
        return source.inline_prompts()
    wanted = set(source.prompt_ids())
    rows = []
    lines = io.BytesIO(_read_range(ref, config.s3_endpoint_url))  # as enqueue read them: on \n only
    for row in jsonl_rows(lines, config.endpoint, first_line=ref.first_line):
        if isinstance(row, Row) and row.prompt.id in wanted:
            wanted.discard(row.prompt.id)  # the first line with an id is the one queued
            rows.append(row)
    if len(rows) != source.count or range_digest(rows) != ref.digest:
        raise InputChanged(f"input {describe(ref)} changed since it was queued (digest or line count "
                           f"differs: {len(rows):,} of the batch's {source.count:,} prompts found); "
                           "nothing was generated from it")
    return [row.prompt for row in rows]


def describe(ref: InputRange) -> str:
    return f"{ref.uri} lines {ref.first_line:,}-{ref.last_line:,} (bytes {ref.start:,}-{ref.end:,})"


def _read_range(ref: InputRange, endpoint_url: str | None) -> bytes:
    want = ref.end - ref.start
    try:
        if is_s3(ref.uri):
            from genq.output import s3

            data = s3.read_object(ref.uri, endpoint_url, (ref.start, ref.end))
        else:
            with open(ref.uri, "rb") as f:
                f.seek(ref.start)
                data = f.read(want)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
        raise InputChanged(f"input {describe(ref)} is gone: {exc}") from None
    except Exception as exc:
        if not is_s3(ref.uri):
            raise
        from genq.output import s3

        if s3.error_code(exc) in (*s3.MISSING, "NoSuchBucket", "InvalidRange", "416"):
            raise InputChanged(f"input {describe(ref)} is gone: {s3.describe(exc, ref.uri)}") from None
        raise
    if len(data) != want:
        raise InputChanged(f"input {describe(ref)} changed: only {len(data):,} of {want:,} bytes are left")
    return data
