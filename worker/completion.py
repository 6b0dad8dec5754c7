"""A batch whose every prompt has an outcome: its shard, its marker, then its release.

The shard is built from what Redis recorded, never from this engine's memory: with
outcomes written once (first writer wins), every holder of the batch builds the same
bytes, so a late second writer overwrites a shard with itself. The release (ledger
RELEASE) happens once; a holder that finds the batch done drops it quietly.
Encoding and uploads run on their own threads, never on the event loop or in the
pool the heartbeat uses.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor

import redis.asyncio as aioredis

from genq.core import batches, keys, ledger
from genq.core.records import BatchRef, DeadLetter, Result, ShardInfo, pack, unpack, with_prompt
from genq.ops.written import adopt_marker, outcome_for
from genq.output.sink import open_sink, shard_bytes
from genq.output.truth import AlreadyWritten
from genq.worker.held import HeldBatch
from genq.worker.leases import retrying

log = logging.getLogger("genq.worker")

SHARD_THREADS = 4


def release_call(ref: BatchRef, info: ShardInfo, token: str) -> tuple[list[str], list]:
    """ledger.RELEASE's keys and arguments for a written shard (bench/footprint.py drives it too)."""
    script_keys = [keys.job_done(ref.job), keys.job_shards(ref.job), keys.batch_results(ref.job, ref.batch),
                   keys.batch(ref.job, ref.batch), keys.job_leases(ref.job), keys.job_transport(ref.job),
                   keys.job_stats(ref.job), keys.batch_claims(ref.job, ref.batch)]
    args = [ref.batch, pack(info), ledger.REPLY_TTL_S, token, keys.lease_reply(ledger.TOKEN_SLOT),
            info.records, info.bytes]
    return script_keys, args


class Completer:
    def __init__(self, conn: aioredis.Redis) -> None:
        self.conn = conn
        self._pool = ThreadPoolExecutor(SHARD_THREADS, thread_name_prefix="genq-shard")
        self._release = conn.register_script(ledger.RELEASE)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def complete(self, held: HeldBatch) -> bool:
        """Write the shard and release the batch; False if it was already done (nothing written)."""
        ref = held.ref
        recorded = await retrying(lambda: self._read(held), f"reading batch {ref}")
        if recorded is None:
            return False
        results, letters = recorded
        # The shard's time is the last outcome's: the same for every writer.
        at = max([r.finished_at for r in results] + [d.at for d in letters], default=0.0)
        loop = asyncio.get_running_loop()
        data = await loop.run_in_executor(self._pool, shard_bytes, results, held.config.compression)
        outcome = outcome_for(held.prompts, results, letters)
        sink = open_sink(held.config)
        backoff = 1.0
        while True:
            try:
                info: ShardInfo = await loop.run_in_executor(
                    self._pool, sink.write_shard, ref.job, ref.batch, data, len(results), at, outcome)
                break
            except AlreadyWritten as written:  # the output's shard of this batch stands (#31)
                adopting = functools.partial(adopt_marker, self.conn, ref, written.marker, held.token)
                return await retrying(adopting, f"adopting batch {ref}")
            except Exception as exc:  # the sink's own errors (disk full, S3 down): keep trying
                log.warning("batch %s: writing shard failed (%s: %s); results stay in Redis, retrying in %.0fs",
                            ref, type(exc).__name__, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 60)
        script_keys, args = release_call(ref, info, held.token)
        released = await retrying(lambda: self._release(keys=script_keys, args=args), f"releasing batch {ref}")
        return bool(released)

    async def _read(self, held: HeldBatch) -> tuple[list[Result], list[DeadLetter]] | None:
        """Everything recorded for the batch, read in one transaction; None once it is done.

        Results are stored without their prompt (records.without_prompt); each is joined here
        with its prompt from the batch the engine holds, so the shard's line is what it was."""
        ref = held.ref
        async with self.conn.pipeline(transaction=True) as pipe:
            pipe.sismember(keys.job_done(ref.job), ref.batch)
            if held.prompts:  # in memory already: only whether the batch record is still there
                pipe.exists(keys.batch(ref.job, ref.batch))
            else:
                pipe.get(keys.batch(ref.job, ref.batch))
            pipe.hvals(keys.batch_results(ref.job, ref.batch))
            done, raw_batch, raw_results = await pipe.execute()
        if done or not raw_batch:
            return None
        by_id = {p.id: p for p in held.prompts}  # empty only if its input could not be read (input_changed)
        ids = list(by_id) if by_id else batches.ids(batches.decode(raw_batch))
        raw_letters = await self.conn.hmget(keys.job_dlq(ref.job), ids)
        results = []
        for v in raw_results:
            r = unpack(v, Result)
            prompt = by_id.get(r.id)
            results.append(with_prompt(r, prompt) if prompt is not None else r)
        letters = [unpack(v, DeadLetter) for v in raw_letters if v is not None]
        return results, letters
