"""Leases: batches arriving from the engine's RQ loops, and leaving again.

    RQ loop --(token, job, batch, rq job)--> inbox --> LeaseDesk.acquire --> on_batch(held, todo)
    LeaseDesk --"done" | "released"--> lease_reply(token) --> the loop's job returns

A lease is one delivery (genq.core.ledger). The desk records it as the batch's current
lease, loads what Redis already recorded for the batch (those prompts are not sent
again), and later tells the loop how it ended. Handing a batch back is done here, in
Redis, by the engine (a new RQ job at the front of the queue, in one transaction with
the lease's end); the loop's job only returns, so no process needs a signal mid-way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis

from genq.core import batches, ledger, scripts
from genq.core.ledger import leasing
from genq.core.records import BatchRef, BatchSource, DeadLetter, JobConfig, Prompt, unpack
from genq.core.redisconn import connect_async
from genq.core.words import plural
from genq.ops.written import adopt_if_written
from genq.producer.batchinput import InputChanged, load_prompts
from genq.worker.held import HeldBatch, Holdings
from genq.worker.idle import INBOX_WAIT_S
from genq.worker.models import ModelGate

log = logging.getLogger("genq.worker")

T = TypeVar("T")
LOAD_TRIES = 4  # reads of a batch's input (S3, a shared path) before the batch is handed back


async def retrying(action: Callable[[], Awaitable[T]], what: str = "redis") -> T:
    """Redis errors (a restart, a dropped connection) are waited out, never lost."""
    backoff = 0.5
    while True:
        try:
            return await action()
        except (redis.RedisError, OSError) as exc:
            log.warning("%s: %s; retrying in %.1fs", what, exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10)


class LeaseDesk:
    def __init__(self, conn: aioredis.Redis, sync_conn: redis.Redis, redis_url: str, instance: str,
                 held: Holdings, on_batch: Callable[[HeldBatch, list[Prompt]], None],
                 add_dead: Callable[[DeadLetter, str], None], worker: str,
                 server_model: Callable[[], str | None] = lambda: None) -> None:
        self.conn = conn
        self.sync_conn = sync_conn  # RQ's enqueue is synchronous
        self.redis_url = redis_url
        self.instance = instance
        self.held = held
        self.on_batch = on_batch
        self.add_dead = add_dead  # the result writer's: a batch whose input changed ends in letters
        self.worker = worker
        # Turns away other models' jobs and pins `auto` ones (worker/models.py).
        self.models = ModelGate(conn, instance, server_model)
        self._acquire = conn.register_script(scripts.ACQUIRE)

    # ---------------------------------------------------------------- arriving

    async def intake(self) -> None:
        inbox_conn = connect_async(self.redis_url)  # BLPOP blocks its connection
        try:
            while True:
                item = await retrying(lambda: leasing.next_delivery(inbox_conn, self.instance, INBOX_WAIT_S), "inbox")
                if item is not None:
                    token, job, batch_id, rq_id = unpack(item, list)
                    ref = BatchRef(job, batch_id)
                    await retrying(functools.partial(self.acquire, token, ref, rq_id), "lease")
        finally:
            await inbox_conn.aclose()

    async def acquire(self, token: str, ref: BatchRef, rq_id: str) -> None:
        word = await self._record_lease(token, ref, rq_id)
        if word != "ok":
            if word == "gone":
                log.warning("batch %s has no record (job deleted?); releasing it", ref)
            await self.reply(token, b"done")
            return
        config = await self.config(ref.job)
        current = self.held.get(ref)
        if current is not None and not current.dropped:
            old = current.token
            if config is not None and current.config.incarnation == config.incarnation:
                # The same batch delivered again (an RQ retry, a duplicate job): one lease drives it,
                # the newest; the older lease's loop is let go.
                current.token = token
                await self.reply(old, b"released")
                return
            current.dropped = True  # a batch of a deleted job under the same name: nothing more of it is sent
            await self.reply(old, b"released")
        if config is not None:
            admitted = await self.models.admit(config)
            if admitted is None:  # another model's job: back to the queue for a server of that model
                await self.hand_back(ref, token)
                return
            config = admitted
        raw = await leasing.batch_record(self.conn, ref)
        if config is None or raw is None:
            await self.reply(token, b"done")
            return
        if await adopt_if_written(self.conn, config, ref, token):  # written before Redis lost it (#31)
            return
        source = batches.decode(raw)
        ids = batches.ids(source)
        finished = await leasing.finished_ids(self.conn, ref, ids)
        unfinished = {i for i in ids if i not in finished}
        prompts: list[Prompt] = []
        changed: str | None = None
        try:  # every prompt, finished ones too: the shard joins each result with its prompt
            prompts = await self._load(source, config)
        except InputChanged as exc:
            changed = (f"{exc}. To run them: restore the input (or fix it), `genq dlq purge --job {ref.job}`, "
                       "enqueue it again")
        except Exception as exc:  # the input is unreachable (S3 down): another try, later or elsewhere
            log.warning("batch %s: cannot read its input (%s: %s); handing it back", ref, type(exc).__name__, exc)
            await self.hand_back(ref, token)
            return
        held = HeldBatch(ref, token, config, size=len(ids), unfinished=unfinished, prompts=prompts)
        self.held[ref] = held
        if finished:
            log.info("batch %s: %d of %s already done, not regenerating them", ref, len(finished), plural(len(ids), "prompt"))
        if changed is not None and unfinished:
            log.error("batch %s: %s; its %d unfinished prompts go to the dead-letter queue", ref, changed,
                      len(unfinished))
            for prompt_id in sorted(unfinished):
                self.add_dead(DeadLetter(id=prompt_id, job=ref.job, batch=ref.batch, attempts=0, kind="input_changed",
                                         message=changed, worker=self.worker, at=time.time()), config.incarnation)
            return
        self.on_batch(held, [p for p in prompts if p.id in unfinished])

    async def _load(self, source: BatchSource, config: JobConfig) -> list[Prompt]:
        """The batch's prompts; a failing read is tried a few times (a blip) before it is given up."""
        for attempt in range(LOAD_TRIES):
            try:
                return await load_prompts(source, config)
            except InputChanged:
                raise
            except Exception as exc:
                if attempt == LOAD_TRIES - 1:
                    raise
                log.warning("batch %s/%s: reading its input failed (%s: %s); retrying", source.job, source.id,
                            type(exc).__name__, exc)
                await asyncio.sleep(min(0.5 * 2 ** attempt, 8))
        raise AssertionError("unreachable")

    async def _record_lease(self, token: str, ref: BatchRef, rq_id: str) -> str:
        """ACQUIRE: "ok" (this lease is now the batch's), "done", or "gone" (no record)."""
        script_keys, args = scripts.acquire_call(ref, token, self.instance, rq_id)
        answer: Any = await self._acquire(keys=script_keys, args=args)
        return answer.decode() if isinstance(answer, bytes) else str(answer)

    async def config(self, job: str) -> JobConfig | None:
        """A job's settings as they are now: read for every delivery, never kept by name (a job
        deleted and enqueued again under its name is another incarnation, with its own)."""
        return await leasing.config_now(self.conn, job)

    # ---------------------------------------------------------------- leaving

    async def reply(self, token: str, word: bytes) -> None:
        async with self.conn.pipeline(transaction=True) as pipe:
            ledger.push_reply(pipe, token, word)
            await pipe.execute()

    async def current(self) -> list[tuple[HeldBatch, str]]:
        """Held batches whose lease is no longer this engine's: (batch, "gone" | "done" | "superseded");
        "gone": the job was deleted, or deleted and enqueued again (another incarnation)."""
        refs = [h for h in self.held.values() if not h.dropped and not h.completing]
        if not refs:
            return []
        lost = []
        for h, (incarnation, done, token) in zip(refs, await leasing.lease_states(self.conn, [h.ref for h in refs])):
            if incarnation != h.config.incarnation:
                lost.append((h, "gone"))
            elif done:
                lost.append((h, "done"))
            elif token != h.token:
                lost.append((h, "superseded"))
        return lost

    async def hand_back(self, ref: BatchRef, token: str) -> bool:
        """Queue the batch again (front of the queue) and let the loop go; False if it was
        done or no longer ours (then there is nothing to give back)."""
        given = await asyncio.to_thread(leasing.hand_back, self.sync_conn, ref, token)
        await self.reply(token, b"released")
        return given

    async def release_late_leases(self) -> None:
        """Batches a loop took just before it was told to stop go straight back."""
        while raw := await leasing.late_delivery(self.conn, self.instance):
            token, job, batch_id, rq_id = unpack(raw, list)
            ref = BatchRef(job, batch_id)
            if await self._record_lease(token, ref, rq_id) == "ok":
                await self.hand_back(ref, token)
            else:
                await self.reply(token, b"done")
