"""A batch whose every prompt has an outcome: its shard, its marker, then its release.

A shard is written only when Redis holds an outcome for every prompt of the batch, for this
incarnation of the job; outcomes lost from Redis (a rollback) send the batch back to work for
those, and RELEASE checks again as it marks the batch done. The shard is built from what Redis
recorded, never from memory: every holder builds the same bytes. Encoding and uploads run on
threads of their own, never on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from genq.core import batches, scripts
from genq.core.ledger import leasing
from genq.core.records import BatchRef, DeadLetter, JobConfig, Result, ShardInfo, ShardMarker, unpack, with_prompt
from genq.core.waits import retrying
from genq.core.words import plural
from genq.ops.written import adopt_marker, outcome_for, written_marker
from genq.output.sink import open_sink, shard_bytes
from genq.output.truth import AlreadyWritten
from genq.worker.held import HeldBatch

log = logging.getLogger("genq.worker")

SHARD_THREADS = 4
SHORT_TRIES = 3  # RELEASE refusing a shard that is not every stored result, this often in a row: let go


@dataclass
class Finished:
    """How completing a batch ended: released now (this engine marked it done), or not (done
    by another holder, or the job is gone); `missing`: prompts with no outcome in Redis, to
    send again (nothing was written)."""

    released: bool = False
    missing: set[str] = field(default_factory=set)


@dataclass
class _Recorded:
    results: list[Result]
    letters: list[DeadLetter]
    prompts: int  # the batch's prompt count
    missing: set[str]  # prompts of the batch with no outcome in Redis


class Completer:
    def __init__(self, conn: aioredis.Redis, backoff: float = 1.0, backoff_max: float = 60.0,
                 wake: asyncio.Event | None = None) -> None:
        self.conn = conn
        self._backoff = backoff, backoff_max  # a shard write's retry: worker --retry-backoff(-max)
        # Set once a shard is written after failing: the intake (idle, every job it could take
        # skipped) takes the job's batches again now, not at its next look up to 30 s later.
        self.wake = wake or asyncio.Event()
        # Batches whose shard cannot be written now (disk full, S3 down), and why: their results stay
        # in Redis while the write is retried; nothing new of their jobs is taken (worker/intake.py).
        self.unwritten: dict[BatchRef, str] = {}
        self._pool = ThreadPoolExecutor(SHARD_THREADS, thread_name_prefix="genq-shard")
        self._release = conn.register_script(scripts.RELEASE)

    def unwritten_jobs(self) -> frozenset[str]:
        return frozenset(ref.job for ref in self.unwritten)

    def note(self) -> str | None:
        """What the worker's status says of shards it cannot write, if any."""
        if not self.unwritten:
            return None
        why = next(reversed(self.unwritten.values()))
        # The cause first: `genq workers` cuts a note at 60 characters.
        return (f"cannot write shards: {why} ({plural(len(self.unwritten), 'batch', 'batches')}; "
                "their results stay in Redis, retrying; taking no new batch of their jobs)")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def complete(self, held: HeldBatch) -> Finished:
        """Write the shard and release the batch, if every prompt has its outcome in Redis."""
        ref = held.ref
        for _ in range(SHORT_TRIES):
            recorded = await retrying(lambda: self._read(held), f"reading batch {ref}")
            if recorded is None:
                return Finished()
            if recorded.missing:
                return Finished(missing=recorded.missing)
            released = await self._write(held, recorded)
            if released != "short":
                return Finished(released=released == 1)
            # Redis lost outcomes after they were read (a rollback): the shard just written is the
            # batch's outcome, as any written shard is, and none of its prompts is generated again.
            marker = await self._written_marker(held)
            if marker is not None:
                adopting = functools.partial(adopt_marker, self.conn, ref, marker)
                return Finished(released=bool(await retrying(adopting, f"adopting batch {ref}")))
            log.warning("batch %s: Redis changed while its shard was written; reading it again", ref)
        # Never marked done short: the batch is let go, and the reconciler queues it again.
        log.error("batch %s: Redis never held exactly the shard's results; letting the batch go", ref)
        return Finished()

    async def _written_marker(self, held: HeldBatch) -> ShardMarker | None:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, written_marker, held.config, held.ref)
        except Exception as exc:  # the output unreachable now: read Redis again instead
            log.warning("batch %s: cannot read its marker (%s: %s)", held.ref, type(exc).__name__, exc)
            return None

    async def _write(self, held: HeldBatch, recorded: _Recorded) -> int | str:
        """The shard, then RELEASE's answer (genq/core/scripts/release.lua)."""
        ref, results, letters = held.ref, recorded.results, recorded.letters
        # The shard's time is the last outcome's: the same for every writer.
        at = max([r.finished_at for r in results] + [d.at for d in letters], default=0.0)
        loop = asyncio.get_running_loop()
        data = await loop.run_in_executor(self._pool, shard_bytes, results, held.config.compression)
        outcome = outcome_for(held.prompts, results, letters, recorded.prompts)
        sink = open_sink(held.config)
        backoff, backoff_max = self._backoff
        try:
            while True:
                try:
                    info: ShardInfo = await loop.run_in_executor(
                        self._pool, sink.write_shard, ref.job, ref.batch, data, len(results), at, outcome)
                    break
                except AlreadyWritten as written:  # the output's shard of this batch stands
                    adopting = functools.partial(adopt_marker, self.conn, ref, written.marker)
                    return int(await retrying(adopting, f"adopting batch {ref}"))
                except Exception as exc:  # the sink's own errors (disk full, S3 down): keep trying
                    self.unwritten[ref] = str(exc) or type(exc).__name__
                    log.warning("batch %s: writing shard failed (%s: %s); results stay in Redis, retrying in %.2gs",
                                ref, type(exc).__name__, exc, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, backoff_max)
        finally:
            if self.unwritten.pop(ref, None) is not None:
                self.wake.set()
        script_keys, args = scripts.release_call(ref, info, held.config.incarnation)
        answer = await retrying(lambda: self._release(keys=script_keys, args=args), f"releasing batch {ref}")
        return answer.decode() if isinstance(answer, bytes) else int(answer)

    async def _read(self, held: HeldBatch) -> _Recorded | None:
        """Everything recorded for the batch, read in one transaction; None once it is done, or
        its job is gone or another incarnation.

        Results are stored without their prompt (records.without_prompt); each is joined here
        with its prompt from the batch the engine holds, so the shard's line is what it was."""
        ref = held.ref
        by_id = {p.id: p for p in held.prompts}  # empty only if its input could not be read (input_changed)
        done, raw_config, raw_batch, raw_results, stored_letters = await leasing.stored_outcomes(
            self.conn, ref, list(by_id))
        if done or not raw_batch or not raw_config:
            return None
        if unpack(raw_config, JobConfig).incarnation != held.config.incarnation:
            return None  # the job was deleted and enqueued again: nothing of this one is written
        # the record itself only when the prompts were not in memory (else: whether it is there)
        ids = batches.ids(batches.decode(raw_batch)) if isinstance(raw_batch, bytes) else list(by_id)
        letters_raw = stored_letters if stored_letters is not None else await leasing.letters_of(self.conn, ref.job, ids)
        wanted = set(ids)
        results = []
        for v in raw_results:
            r = unpack(v, Result)
            if r.id not in wanted:
                continue
            prompt = by_id.get(r.id)
            results.append(with_prompt(r, prompt) if prompt is not None else r)
        letters = [unpack(v, DeadLetter) for v in letters_raw if v is not None]
        missing = wanted - {r.id for r in results} - {d.id for d in letters}
        return _Recorded(results, letters, prompts=len(ids), missing=missing)
