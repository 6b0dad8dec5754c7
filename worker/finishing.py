"""How a held batch ends: complete (its shard written and released, worker/completion.py),
sent back to work for outcomes lost from Redis, or let go because the ledger says another
lease drives it, it is done elsewhere, or its job is gone (deleted, or enqueued again as a
new incarnation).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from genq.core.records import BatchRef
from genq.core.words import plural
from genq.worker.claims import Claims
from genq.worker.completion import Completer
from genq.worker.dispatch import Dispatcher
from genq.worker.held import HeldBatch, Holdings
from genq.worker.leases import LeaseDesk, retrying

log = logging.getLogger("genq.worker")


class BatchEnds:
    def __init__(self, held: Holdings, dispatcher: Dispatcher, completer: Completer, leases: LeaseDesk,
                 claims: Claims, borrowed_written: Callable[[BatchRef, list[str]], None]) -> None:
        self.held = held
        self.dispatcher = dispatcher
        self.completer = completer
        self.leases = leases
        self.claims = claims
        self.borrowed_written = borrowed_written  # outcomes of prompts this engine borrowed (worker/stealing.py)
        self.completed = 0
        self.completions: set[asyncio.Task[None]] = set()

    def on_written(self, job: str, batch: str, ids: list[str]) -> None:
        """Outcomes recorded, by this engine or (lent prompts) another one."""
        held = self.held.get(BatchRef(job, batch))
        if held is None:
            self.borrowed_written(BatchRef(job, batch), ids)
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
            await retrying(functools.partial(self.leases.hand_back, held.ref, held.token), f"handing back {held.ref}")
            self.held.pop(held.ref, None)
            return
        held.unfinished |= missing
        self.dispatcher.todo.add(held, [p for p in held.prompts if p.id in missing])

    async def check_leases(self) -> None:
        """After each heartbeat: let go of batches whose lease is no longer this engine's."""
        for held, why in await self.leases.current():
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
