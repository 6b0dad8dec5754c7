"""Idempotent enqueue: prompts in, batches and RQ jobs out.

Ids already queued (or done) for the job are skipped; an id seen before with
different content is rejected, never silently replaced.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import redis

from genq.core import keys
from genq.core.queueing import new_batches, write_batches
from genq.core.records import JobConfig, Prompt, Rejected
from genq.producer.rows import content_digest

LOOKUP_CHUNK = 8192  # ids checked against Redis per round trip


@dataclass
class EnqueueSummary:
    read: int = 0
    enqueued: int = 0
    batches: int = 0
    skipped_existing: int = 0  # already queued or done in an earlier run
    skipped_duplicate: int = 0  # same id, same content, twice in this input
    rejected: list[Rejected] = field(default_factory=list)


class Enqueuer:
    def __init__(self, conn: redis.Redis, config: JobConfig) -> None:
        self.conn = conn
        self.config = config
        self.summary = EnqueueSummary()
        self._seen: dict[str, str] = {}  # id -> digest within this run
        self._pending: list[Prompt] = []
        self._pending_digests: dict[str, str] = {}

    def run(self, rows: Iterable[Prompt | Rejected], on_progress=None) -> EnqueueSummary:
        for chunk in _chunks(rows, LOOKUP_CHUNK):
            self._add_chunk(chunk)
            if on_progress:
                on_progress(self.summary)
        self._flush(final=True)
        return self.summary

    def _add_chunk(self, rows: list[Prompt | Rejected]) -> None:
        prompts: list[tuple[Prompt, str]] = []
        for row in rows:
            if isinstance(row, Rejected):
                self.summary.rejected.append(row)
                continue
            self.summary.read += 1
            digest = content_digest(row)
            earlier = self._seen.get(row.id)
            if earlier is not None:
                if earlier == digest:
                    self.summary.skipped_duplicate += 1
                else:
                    self.summary.rejected.append(_conflict(row, "earlier in this input"))
                continue
            self._seen[row.id] = digest
            prompts.append((row, digest))
        if not prompts:
            return
        stored = self.conn.hmget(keys.job_ids(self.config.name), [p.id for p, _ in prompts])
        for (prompt, digest), known in zip(prompts, stored):
            if known is None:
                self._pending.append(prompt)
                self._pending_digests[prompt.id] = digest
            elif known.decode() == digest:
                self.summary.skipped_existing += 1
            else:
                self.summary.rejected.append(_conflict(prompt, "in an earlier enqueue of this job"))
        self._flush(final=False)

    def _flush(self, final: bool) -> None:
        size = self.config.batch_size
        ready = len(self._pending) if final else len(self._pending) - len(self._pending) % size
        if ready <= 0:
            return
        taking, self._pending = self._pending[:ready], self._pending[ready:]
        batches = new_batches(self.conn, self.config.name, taking, size)
        digests = {p.id: self._pending_digests.pop(p.id) for p in taking}
        # One transaction per group of batches keeps pipelines a sensible size.
        for start in range(0, len(batches), 64):
            group = batches[start : start + 64]
            with self.conn.pipeline(transaction=True) as pipe:
                write_batches(pipe, self.conn, group, {p.id: digests[p.id] for b in group for p in b.prompts})
                pipe.execute()
        self.summary.enqueued += len(taking)
        self.summary.batches += len(batches)


def _conflict(prompt: Prompt, where: str) -> Rejected:
    return Rejected(
        line=prompt.index + 1,
        reason=f"duplicate id {prompt.id!r} with different content ({where})",
        text=prompt.id,
    )


def _chunks(rows: Iterable[Prompt | Rejected], size: int) -> Iterator[list[Prompt | Rejected]]:
    chunk: list[Prompt | Rejected] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
