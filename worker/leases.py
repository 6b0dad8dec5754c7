"""Leases: a batch the engine took (worker/intake.py, TAKE) is loaded, and given back.

A lease is one delivery (genq.core.ledger). The desk loads what Redis already recorded for a
taken batch (those prompts are not sent again) and hands the rest to dispatch. Handing a batch
back is one transaction: a new RQ job at the front of the queue, the lease's end, the old RQ
job out of RQ.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis
import redis.asyncio as aioredis

from genq.core import batches
from genq.core.ledger import leasing
from genq.core.records import BatchRef, BatchSource, DeadLetter, JobConfig, Prompt
from genq.core.words import plural
from genq.ops.written import adopt_if_written
from genq.producer.batchinput import InputChanged, load_prompts
from genq.worker.held import HeldBatch, Holdings
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
    def __init__(self, conn: aioredis.Redis, sync_conn: redis.Redis, instance: str,
                 held: Holdings, on_batch: Callable[[HeldBatch, list[Prompt]], None],
                 add_dead: Callable[[DeadLetter, str], None], worker: str,
                 server_model: Callable[[], str | None] = lambda: None) -> None:
        self.conn = conn
        self.sync_conn = sync_conn  # RQ's enqueue is synchronous
        self.instance = instance
        self.held = held
        self.on_batch = on_batch
        self.add_dead = add_dead  # the result writer's: a batch whose input changed ends in letters
        self.worker = worker
        # Turns away other models' jobs and pins `auto` ones (worker/models.py).
        self.models = ModelGate(conn, instance, server_model)

    async def acquire(self, token: str, ref: BatchRef, rq_id: str) -> None:
        """Load a batch TAKE leased to this engine under `token`."""
        config = await self.config(ref.job)
        current = self.held.get(ref)
        if current is not None and not current.dropped:
            old = current.token
            if config is not None and current.config.incarnation == config.incarnation:
                # The same batch taken again (queued twice): one lease drives it, the newest.
                log.debug("batch %s taken again; lease %s replaces %s", ref, token, old)
                current.token = token
                return
            current.dropped = True  # a batch of a deleted job under the same name: nothing more of it is sent
        if config is not None:
            admitted = await self.models.admit(config)
            if admitted is None:  # another model's job: back to the queue for a server of that model
                await self.hand_back(ref, token)
                return
            config = admitted
        raw = await leasing.batch_record(self.conn, ref)
        if config is None or raw is None:
            return  # the job was deleted meanwhile: its lease goes with it
        if await adopt_if_written(self.conn, config, ref):  # written before Redis lost it
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

    async def config(self, job: str) -> JobConfig | None:
        """A job's settings as they are now: read for every delivery, never kept by name (a job
        deleted and enqueued again under its name is another incarnation, with its own)."""
        return await leasing.config_now(self.conn, job)

    # ---------------------------------------------------------------- leaving

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
        """Queue the batch again (front of the queue); False if it was done or no longer ours
        (then there is nothing to give back)."""
        return await asyncio.to_thread(leasing.hand_back, self.sync_conn, ref, token)
