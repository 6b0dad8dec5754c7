"""What the heartbeat last read: the operator's controls (drain, pause, a live concurrency cap) and
when it last checked the leases. The heartbeat alone writes them; every other part reads them."""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis

from genq.core.ledger import fleet
from genq.core.timings import LEASE_CHECK_STALE_S
from genq.worker.controller import ConcurrencyController

log = logging.getLogger("genq.worker")


class Controls:
    def __init__(self, conn: aioredis.Redis, name: str, controller: ConcurrencyController) -> None:
        self.conn = conn
        self.name = name
        self.controller = controller
        self.paused_all = False
        self.paused_jobs: set[str] = set()
        self.draining = False
        # When the heartbeat last checked the leases (monotonic): a longer gap than a lease survives
        # (a frozen process) stops dispatch until they are checked again.
        self.last_beat = time.monotonic()

    def leases_fresh(self) -> bool:
        """The leases were checked recently enough to send on them."""
        return time.monotonic() - self.last_beat < LEASE_CHECK_STALE_S

    def leases_checked(self) -> None:
        self.last_beat = time.monotonic()

    async def read(self, jobs: list[str]) -> bool:
        """Applies the operator's controls for these jobs; True if one changed."""
        control, paused, paused_jobs = await fleet.read_controls(self.conn, self.name, jobs)
        changed = False
        if control.drain and not self.draining:
            log.info("drain requested: finishing held batches, taking no new ones")
            self.draining = changed = True
        if (control.concurrency or None) != self.controller.live_cap:
            self.controller.set_cap(control.concurrency)
            log.info("concurrency cap now %s (target %d)", control.concurrency or "auto", self.controller.target)
            changed = True
        if paused != self.paused_all or paused_jobs != self.paused_jobs:
            _log_pause_change(self.paused_all, self.paused_jobs, paused, paused_jobs)
            self.paused_all, self.paused_jobs = paused, paused_jobs
            changed = True
        return changed


def _log_pause_change(was_all: bool, was: set[str], now_all: bool, now: set[str]) -> None:
    """Says what the operator changed since the last read: "paused: a" and "resumed: a" (not the
    whole set: an empty one read as "none"). A paused job's batches stay parked here until `genq
    resume` queues them again, so a job that leaves the set read was resumed (or deleted)."""
    if now_all != was_all:
        log.info("%s all jobs", "paused:" if now_all else "resumed:")
    if now - was:
        log.info("paused: %s", ", ".join(sorted(now - was)))
    if was - now:
        log.info("resumed: %s", ", ".join(sorted(was - now)))
