"""Claims: one sender per prompt, so prompts can move between engines at the end of a job.

A batch has one lease (its holder), but each prompt is claimed (keys.batch_claims) by the engine
about to send it, as "INSTANCE TOKEN": the holder claims a few ahead of its free slots, the rest
stays unclaimed for idle engines to take from the back (worker/stealing.py). A claim counts while
its lease is the batch's current one and its engine beats; an outcome ends it (RECORD), RELEASE
drops them all. Taking over a dead engine's claim is a try lost, counted in keys.batch_tries
(Task.lost). Claims keep two live engines off one prompt; exactly once is RECORD's (first writer wins).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis

from genq.core import scripts
from genq.core.ledger import leasing
from genq.core.records import BatchRef
from genq.worker.held import HeldBatch


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Claims:
    """The claim scripts, for one engine instance."""

    def __init__(self, conn: aioredis.Redis, instance: str) -> None:
        self.conn = conn
        self.instance = instance
        self._claim = conn.register_script(scripts.CLAIM)
        self._steal = conn.register_script(scripts.STEAL)
        self._unclaim = conn.register_script(scripts.UNCLAIM)

    async def claim(self, held: HeldBatch, ids: list[str]) -> tuple[str, dict[int, int]] | None:
        """One letter per id (see CLAIM) and the tries lost on claimed ones, by position;
        None once the batch is done; "" if this lease does not drive the batch now (the lease
        check then tells what happened)."""
        if not ids:
            return "", {}
        script_keys, args = scripts.claim_call(held.ref, self.instance, held.config.incarnation, held.token, ids)
        answer = await self._claim(keys=script_keys, args=args)
        if not isinstance(answer, list):
            return None if _text(answer) == "done" else ("", {})
        lost = answer[1:]
        return _text(answer[0]), {int(lost[i]) - 1: int(lost[i + 1]) for i in range(0, len(lost), 2)}

    async def steal(self, ref: BatchRef, incarnation: str, holder: str, ids_back_first: list[str],
                    n: int) -> dict[str, int]:
        """The ids claimed, each with the tries it had lost."""
        script_keys, args = scripts.steal_call(ref, self.instance, incarnation, holder, ids_back_first, n)
        answer = await self._steal(keys=script_keys, args=args)
        if not answer:
            return {}
        return {_text(i): int(lost) for i, lost in zip(answer[0], answer[1])}

    async def unclaim(self, held: HeldBatch, ids: Iterable[str] = ()) -> None:
        script_keys, args = scripts.unclaim_call(held.ref, self.instance, held.config.incarnation, ids)
        await self._unclaim(keys=script_keys, args=args)

    async def finished_ids(self, ref: BatchRef, ids: list[str]) -> set[str]:
        """Of these prompts, those with an outcome recorded (read only)."""
        return set(await leasing.outcome_ids(self.conn, ref, ids))

    async def mine(self, ref: BatchRef, ids: list[str]) -> list[bool]:
        owners = await leasing.claim_owners(self.conn, ref, ids)
        return [o is not None and _text(o).partition(" ")[0] == self.instance for o in owners]

