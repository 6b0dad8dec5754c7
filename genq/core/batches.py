"""A batch's record in Redis (records.BatchSource): built, decoded and its ids read here only.
Inline batches carry their prompts zstd-compressed, by-reference ones an InputRange
(genq.producer.batchinput reads it); both carry their ids, so what needs only ids reads no prompt.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import msgspec
import zstandard

from genq.core.records import BatchSource, InputRange, Prompt, pack

# The fastest level: prompts come out at 0.28 of their JSON (level 3: 0.26, at 1.6 times the time).
ZSTD_LEVEL = 1
_local = threading.local()  # zstd contexts are not thread-safe: one pair per thread
_ids_decoder = msgspec.msgpack.Decoder(list[str])
_prompts_decoder = msgspec.msgpack.Decoder(list[Prompt])
_source_decoder = msgspec.msgpack.Decoder(BatchSource)


def _contexts() -> threading.local:
    if not hasattr(_local, "c"):
        _local.c, _local.d = zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor()
    return _local


def compress(data: bytes) -> bytes:
    return _contexts().c.compress(data)


def decompress(data: bytes) -> bytes:
    return _contexts().d.decompress(data)


def inline(job: str, batch_id: str, prompts: Sequence[Prompt], created_at: float = 0.0) -> BatchSource:
    return BatchSource(job=job, id=batch_id, count=len(prompts), ids=compress(pack([p.id for p in prompts])),
                       created_at=created_at, prompts=compress(pack(list(prompts))))


def by_reference(job: str, batch_id: str, ids: Sequence[str], ref: InputRange,
                 created_at: float = 0.0) -> BatchSource:
    return BatchSource(job=job, id=batch_id, count=len(ids), ids=compress(pack(list(ids))),
                       created_at=created_at, ref=ref)


def decode(raw: bytes) -> BatchSource:
    """The record under keys.batch()."""
    return _source_decoder.decode(raw)


def ids(source: BatchSource) -> list[str]:
    return _ids_decoder.decode(decompress(source.ids))


def inline_prompts(source: BatchSource) -> list[Prompt]:
    """The prompts of an inline batch (raises ValueError for a by-reference one)."""
    if source.ref is not None:
        raise ValueError(f"batch {source.job}/{source.id} is by reference: read it with genq.producer.batchinput")
    return _prompts_decoder.decode(decompress(source.prompts))


def batch_id(seq: int) -> str:
    """The id of a job's seq-th batch."""
    return f"b{seq:07d}"


def batch_number(batch: str) -> int:
    """batch_id's inverse: b0000017 -> 17 (the order of keys.job_batches); 0 for an id genq did not number."""
    digits = batch[1:].split(".", 1)[0]
    return int(digits) if digits.isdigit() else 0
