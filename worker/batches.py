"""The life of every batch this engine holds, from the moment the intake took it (TAKE,
worker/intake.py) to its end; one owner, `Batches`.

    taken --load--> arrived --admitted (worker/parking.py)--> sending --every prompt has an outcome-->
      completing --shard written, RELEASE--> done
      |  sending <--outcomes lost from Redis (a rollback)-- completing
      |--lease no longer ours (done elsewhere, leased again, job gone)--> let go
      |--handed back (stopping, server gone or changed model, input unreadable)--> queued
      |--its job blocked or paused--> parked (its lease ended, no RQ job: `genq resume --job` queues it)
      |--another model's job, or written already (ADOPT)--> queued / done

A held batch is a `HeldBatch` (worker/held.py) in `held`; `completing` and `dropped` are its
state past sending. The lease rules are the ledger's (genq.core.ledger, docs/exactly-once.md):
the newest lease drives a batch, and one that is no longer this engine's sends nothing more.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable

import redis
import redis.asyncio as aioredis

from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger import leasing
from genq.core.records import BatchRef, BatchSource, DeadLetter, JobConfig, Prompt, unpack
from genq.core.waits import retrying
from genq.core.words import plural
from genq.ops.written import adopt_if_written
from genq.producer.batchinput import InputChanged, load_prompts
from genq.worker.claims import Claims
from genq.worker.completion import Completer
from genq.worker.dispatch import Dispatcher
from genq.worker.held import HeldBatch, Holdings
from genq.worker.idle import wake_fleet
from genq.worker.models import ModelGate
from genq.worker.results import ResultWriter

log = logging.getLogger("genq.worker")

LOAD_TRIES = 4  # reads of a batch's input (S3, a shared path) before the batch is handed back


class Batches:
    def __init__(self, conn: aioredis.Redis, sync_conn: redis.Redis, worker: str, held: Holdings,
                 dispatcher: Dispatcher, claims: Claims, writer: ResultWriter, completer: Completer,
                 models: ModelGate) -> None:
        self.conn = conn
        self.sync_conn = sync_conn  # RQ's enqueue (the hand-back) is synchronous
        self.worker = worker
        self.held = held
        self.dispatcher = dispatcher
        self.claims = claims
        self.writer = writer
        self.completer = completer
        self.models = models  # turns away other models' jobs, pins `auto` ones (worker/models.py)
        # Loaded batches and their unfinished prompts: parking admits them (blocked jobs, the preflight).
        self.arrived: asyncio.Queue[tuple[HeldBatch, list[Prompt]]] = asyncio.Queue()
        self.completed = 0
        self.handed_back = 0
        self.completions: set[asyncio.Task[None]] = set()

    # ---------------------------------------------------------------- taken

    async def load(self, token: str, ref: BatchRef, rq_id: str) -> None:
        """A batch TAKE leased to this engine under `token`: what Redis recorded of it is not sent again."""
        config = (await ledger_jobs.jobs_now(self.conn, [ref.job]))[0].config  # never kept by name: a job's life is its own
        current = self.held.get(ref)
        if current is not None and not current.dropped:
            if config is not None and current.config.incarnation == config.incarnation:
                log.debug("batch %s taken again; lease %s replaces %s", ref, token, current.token)
                current.token = token  # queued twice: one lease drives it, the newest
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
        source = unpack(raw, BatchSource)
        ids = source.prompt_ids()
        finished = await leasing.outcome_ids(self.conn, ref, ids, transaction=True)
        unfinished = {i for i in ids if i not in finished}
        prompts: list[Prompt] = []
        changed: str | None = None
        try:  # every prompt, finished ones too: the shard joins each result with its prompt
            prompts = await self._read(source, config)
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
            log.info("batch %s: %d of %s already done, not regenerating them", ref, len(finished),
                     plural(len(ids), "prompt"))
        if changed is not None and unfinished:
            log.error("batch %s: %s; its %d unfinished prompts go to the dead-letter queue", ref, changed,
                      len(unfinished))
            for prompt_id in sorted(unfinished):
                self.writer.add_dead(DeadLetter(id=prompt_id, job=ref.job, batch=ref.batch, attempts=0,
                                                kind="input_changed", message=changed, worker=self.worker,
                                                at=time.time()), config.incarnation)
            return
        self.arrived.put_nowait((held, [p for p in prompts if p.id in unfinished]))

    def send(self, held: HeldBatch, prompts: list[Prompt]) -> None:
        """An admitted batch's prompts go to dispatch; what this engine had borrowed of it is the lease's
        now, already on its way."""
        borrowed = self.held.borrowed.pop(held.ref, None)
        adopted = set() if borrowed is None else self.dispatcher.todo.adopt(borrowed, held, iter(self.dispatcher.running))
        self.dispatcher.todo.add(held, [p for p in prompts if p.id not in adopted])

    async def _read(self, source: BatchSource, config: JobConfig) -> list[Prompt]:
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

    # ---------------------------------------------------------------- sending -> completing -> done

    def on_written(self, job: str, batch: str, ids: list[str]) -> None:
        """Outcomes recorded, by this engine or (lent prompts) another one."""
        ref = BatchRef(job, batch)
        held = self.held.get(ref)
        if held is None:  # borrowed prompts (worker/stealing.py): their holder writes the shard
            borrowed = self.held.borrowed.get(ref)
            if borrowed is not None:
                borrowed.unfinished.difference_update(ids)
                if not borrowed.unfinished:
                    self.held.borrowed.pop(ref)
            return
        held.unfinished.difference_update(ids)
        if not held.unfinished and not held.completing and not held.dropped:
            held.completing = True
            task = asyncio.create_task(self._complete(held))
            self.completions.add(task)
            task.add_done_callback(self.completions.discard)

    async def _complete(self, held: HeldBatch) -> None:
        finished = await self.completer.complete(held)
        if finished.missing:
            await self._redo(held, finished.missing)
            return
        if finished.released:
            self.completed += 1
        self.held.pop(held.ref, None)
        self.dispatcher.wake.set()

    async def _redo(self, held: HeldBatch, missing: set[str]) -> None:
        """Outcomes lost from Redis (a rollback): the batch goes back to work for those prompts."""
        log.warning("batch %s: %s no outcome in Redis (lost from it?): sending again",
                    held.ref, plural(len(missing), "prompt has", "prompts have"))
        held.completing = False
        if not held.prompts:  # its input could not be read: the next delivery dead-letters them again
            self.dispatcher.drop(held, cancel=True)
            await retrying(functools.partial(self.hand_back, held.ref, held.token), f"handing back {held.ref}")
            self.held.pop(held.ref, None)
            return
        held.unfinished |= missing
        self.dispatcher.todo.add(held, [p for p in held.prompts if p.id in missing])

    # ---------------------------------------------------------------- let go

    async def check_leases(self) -> None:
        """After each heartbeat: let go of batches whose lease is no longer this engine's."""
        for held, why in await self._lost():
            if why == "gone":
                log.info("batch %s: its job was deleted (or enqueued again as a new job): dropping it", held.ref)
            else:
                log.info("batch %s %s elsewhere: dropping it here", held.ref,
                         "was completed" if why == "done" else "was leased again")
            # Requests in flight finish (first writer wins), unless nothing of them may be recorded.
            unsent = self.dispatcher.drop(held, cancel=why == "gone")
            self.held.pop(held.ref, None)
            await self.claims.unclaim(held, unsent)
        await self.dispatcher.todo.check_claims()
        for held in list(self.held.values()):
            if not held.unfinished and not held.completing and not held.dropped:
                self.on_written(held.ref.job, held.ref.batch, [])

    async def _lost(self) -> list[tuple[HeldBatch, str]]:
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

    # ---------------------------------------------------------------- handed back

    async def hand_back(self, ref: BatchRef, token: str) -> bool:
        """Queue the batch again (front of the queue); False if it was done or no longer ours
        (then there is nothing to give back)."""
        return await asyncio.to_thread(leasing.end_lease, self.sync_conn, ref, token, requeue=True)

    async def hand_back_all(self, why: str) -> None:
        """Give every held batch back to the queue, and borrowed prompts to their holders; what
        finished stays finished."""
        await self.give_back_borrowed(why)
        given = await self._let_go([h for h in self.held.values() if not h.completing], [], cancel=True,
                                   end=self.hand_back_held)
        self.handed_back += len(given)
        if given:
            log.info("%s: handed back %s (%s)", why, plural(len(given), "batch", "batches"), ", ".join(given))

    async def give_back_borrowed(self, why: str) -> None:
        """Borrowed prompts go back to their holders: nothing more is sent, what was recorded is
        written, then the claims go, and idle workers hear of them."""
        borrowed = list(self.held.borrowed.values())
        if not borrowed:
            return
        log.info("%s: giving %s back to their holders", why,
                 plural(sum(len(b.unfinished) for b in borrowed), "borrowed prompt"))
        await self._let_go([], borrowed, cancel=True, end=self.hand_back_held)
        await wake_fleet(self.conn)

    async def hand_back_held(self, held: HeldBatch) -> bool:
        return await self.hand_back(held.ref, held.token)

    async def park(self, job: str, *, cancel: bool) -> list[str]:
        """Park the job's batches: their leases end with no RQ job carrying them (`genq resume --job`
        queues them again), borrowed prompts of it go back. Blocked (`cancel`), its requests in flight
        are cancelled (nothing recorded); paused, they finish and are recorded. The batches parked."""
        mine = [h for h in self.held.values() if h.ref.job == job and not h.completing and not h.dropped]
        borrowed = [b for ref, b in self.held.borrowed.items() if ref.job == job]
        return await self._let_go(mine, borrowed, cancel=cancel,
                                  end=lambda h: asyncio.to_thread(leasing.end_lease, self.sync_conn, h.ref, h.token, requeue=False))

    async def _let_go(self, mine: list[HeldBatch], borrowed: list[HeldBatch], *, cancel: bool,
                      end: Callable[[HeldBatch], Awaitable[bool]]) -> list[str]:
        """Send nothing more of these batches (with `cancel`, stop their requests in flight too), write
        what was recorded, drop their claims and end each lease by `end`; the batches whose lease it ended."""
        for batch in mine + borrowed:
            self.dispatcher.drop(batch, cancel=cancel)
        while any(t.batch in mine or t.batch in borrowed for t in self.dispatcher.running):
            await asyncio.sleep(0.05)
        await self.writer.wait_idle()  # what was recorded is written: it stays
        for b in borrowed:
            await retrying(functools.partial(self.claims.unclaim, b), f"releasing claims of {b.ref}")
            self.held.borrowed.pop(b.ref, None)
        ended = []
        for h in mine:
            if h.completing:
                continue  # the flush above finished it
            await retrying(functools.partial(self.claims.unclaim, h), f"releasing claims of {h.ref}")
            if await retrying(functools.partial(end, h), f"ending the lease of {h.ref}"):
                ended.append(str(h.ref))
            self.held.pop(h.ref, None)
        self.dispatcher.wake.set()
        return ended
