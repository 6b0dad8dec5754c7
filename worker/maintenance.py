"""Every worker's share of keeping the fleet honest: the ledger's reconciler
(genq.core.ledger), and the burst worker's decision to leave.

Not RQ's abandoned-job cleanup (StartedJobRegistry.cleanup): it compares scores other
workers wrote with their wall clocks against this machine's, so one skewed clock failed
healthy batches fleet-wide. The reconciler decides from Redis TTLs (engine heartbeats) alone."""

from __future__ import annotations

import asyncio
import logging

import redis

from genq.core.ledger import Reconciler
from genq.core.timings import RECONCILE_EVERY_S
from genq.ops.recover import OutputWatch
from genq.ops.settings import blocked_jobs
from genq.producer.enqueue import queue_lost
from genq.worker.idle import IdlePace

log = logging.getLogger("genq.worker")


class Maintenance:
    def __init__(self, conn: redis.Redis, reconciler: Reconciler, pace: IdlePace) -> None:
        self.conn = conn
        self.reconciler = reconciler
        self.pace = pace  # the engine's one idleness (the stealer's): idle, a turn every IDLE_MAINTENANCE_S
        self.outputs = OutputWatch(conn, queue_lost)  # the ledger checked against the written output

    async def run(self) -> None:
        """Stranded batches are looked for by every worker (one pass at a time across the fleet)."""
        while True:
            await asyncio.sleep(self.pace.maintenance_every(RECONCILE_EVERY_S))
            try:
                await asyncio.to_thread(self.outputs.pass_once)
                outlook = await asyncio.to_thread(self.reconciler.pass_once)
                self.pace.open_work = bool(outlook.unfinished or outlook.finishing)
            except (redis.RedisError, OSError) as exc:
                log.debug("maintenance skipped: %s", exc)

    async def burst_done(self) -> bool:
        """A burst worker leaves once the ledger says every batch of every job is done; False while
        batches are queued again (stranded, or handed back by others): the intake takes them."""
        await asyncio.to_thread(self.outputs.pass_once)
        outlook = await asyncio.to_thread(self.reconciler.pass_once, force=True)
        if not outlook.unfinished and not outlook.finishing:
            blocked = await asyncio.to_thread(blocked_jobs, self.conn)  # they wait: docs/settings.md
            log.info("burst: every batch of every job is done%s; exiting",
                     f" but those of blocked jobs ({', '.join(blocked)}: genq jobs show JOB)" if blocked else "")
            return True
        await asyncio.sleep(1.0)
        return False
