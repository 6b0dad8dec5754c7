"""A batch's prompts, wherever they are: the one place a batch record becomes prompts.

Inline batches decompress (genq.core.batches). By-reference batches read their byte
range of the input (a ranged GET on S3, or a seek in a file every worker can read),
parse those lines exactly as enqueue did, keep the batch's ids, and check the
range digest: a line that is missing, changed or moved raises InputChanged, and the
worker dead-letters the whole batch rather than send anything read from the wrong lines.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable

from genq.core import batches
from genq.core.records import BatchSource, Endpoint, InputRange, JobConfig, Prompt
from genq.producer.files import is_s3
from genq.producer.rows import Row, RowError, fit_endpoint, parse_line


class InputChanged(Exception):
    """The input lines of a by-reference batch are not the ones queued (or are gone)."""


def range_digest(rows: Iterable[tuple[int, bytes]]) -> str:
    """Digest of (1-based line number, stripped line) of each prompt of a batch, in input order."""
    return hashlib.blake2b(b"".join([b"%d\0%b\n" % item for item in rows]), digest_size=16).hexdigest()


def row_digest_items(rows: Iterable[Row]) -> Iterable[tuple[int, bytes]]:
    for row in rows:
        assert isinstance(row.source, bytes), "by-reference batches come from JSONL lines"
        yield row.prompt.index + 1, row.source


async def load_prompts(source: BatchSource, config: JobConfig) -> list[Prompt]:
    """The batch's prompts, in input order, read without blocking the event loop.

    Raises InputChanged (dead-letter the batch: kind input_changed) or, for a transient
    failure (S3 unreachable, a disk error), the underlying error (try again later).
    """
    if source.ref is None:
        return await asyncio.to_thread(batches.inline_prompts, source)
    return await asyncio.to_thread(read_prompts, source, config)


def read_prompts(source: BatchSource, config: JobConfig) -> list[Prompt]:
    """load_prompts for synchronous callers (export, the audit)."""
    if source.ref is None:
        return batches.inline_prompts(source)
    ref = source.ref
    data = _read_range(ref, config.s3_endpoint_url)
    return _parse_range(source, ref, data, config.endpoint)


def describe(ref: InputRange) -> str:
    return f"{ref.uri} lines {ref.first_line:,}-{ref.last_line:,} (bytes {ref.start:,}-{ref.end:,})"


def _read_range(ref: InputRange, endpoint_url: str | None) -> bytes:
    want = ref.end - ref.start
    if is_s3(ref.uri):
        from genq.output import s3

        bucket, key = s3.parse_uri(ref.uri)
        try:
            resp = s3.client(endpoint_url).get_object(Bucket=bucket, Key=key, Range=f"bytes={ref.start}-{ref.end - 1}")
            data = resp["Body"].read()
        except Exception as exc:
            if s3.error_code(exc) in ("NoSuchKey", "404", "NotFound", "NoSuchBucket", "InvalidRange", "416"):
                raise InputChanged(f"input {describe(ref)} is gone: {s3.describe(exc, ref.uri)}") from None
            raise
    else:
        try:
            with open(ref.uri, "rb") as f:
                f.seek(ref.start)
                data = f.read(want)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise InputChanged(f"input {describe(ref)} is gone: {exc}") from None
    if len(data) != want:
        raise InputChanged(f"input {describe(ref)} changed: only {len(data):,} of {want:,} bytes are left")
    return data


def _parse_range(source: BatchSource, ref: InputRange, data: bytes, endpoint: Endpoint) -> list[Prompt]:
    wanted = set(batches.ids(source))
    rows: list[Row] = []
    lines = data.split(b"\n")  # as enqueue read them: on \n only (bytes.splitlines also splits on \r)
    if lines and not lines[-1]:
        lines.pop()
    for line_no, raw in enumerate(lines, start=ref.first_line):
        row = parse_line(line_no, raw)
        if isinstance(row, Row) and row.prompt.id in wanted:
            wanted.discard(row.prompt.id)  # the first line with an id is the one queued
            rows.append(row)
    prompts = []
    for row in rows:
        try:
            fit_endpoint(row.prompt, endpoint)
        except RowError:
            continue  # was valid at enqueue: the digest below says the line changed
        prompts.append(row.prompt)
    if len(prompts) != source.count or range_digest(row_digest_items(rows)) != ref.digest:
        raise InputChanged(f"input {describe(ref)} changed since it was queued (digest or line count "
                           f"differs: {len(prompts):,} of the batch's {source.count:,} prompts found); "
                           "nothing was generated from it")
    return prompts
